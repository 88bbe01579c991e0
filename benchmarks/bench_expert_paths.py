"""Generation A/B of the MoE expert paths, in one process, on the same requests.

"dispatch+loop": sort tokens by expert, one Python-level GEMM chain per expert (the training path);
"dispatch+grouped_mm": the same dispatch, each projection one ``torch._grouped_mm`` call (inference
default); "all-experts" adds the small-batch path that computes every expert for every token (in the
engine that is the fused forward's, ``training/model/fused_forward.py``; ``MoETransformer.forward`` has
its own in ``training/model/moe.py``), used only within the ``moe.DENSE_DECODE_*`` bounds. Rates are
generated tokens per CPU-second of the benchmark thread, best of N, contenders interleaved; tokens must
be identical.

    .venv/bin/python benchmarks/bench_expert_paths.py --size small --workload uniform
    .venv/bin/python benchmarks/bench_expert_paths.py --size tiny --workload mixed
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.generation_workload import decode_workload
from kernels import moe_experts
from training.engine import EngineConfig, GenerationEngine
from training.model import moe

PATHS = {
    # name: (grouped_mm without autograd, all-experts row bound)
    "dispatch+loop": (False, 0),
    "dispatch+grouped_mm": (True, 0),
    "all-experts+grouped_mm (default)": (True, moe.DENSE_DECODE_MAX_ROWS),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--workload", choices=("uniform", "mixed"), default="uniform")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, prompts, params = decode_workload(size=args.size, workload=args.workload, batch=args.batch)
    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=args.batch, max_seq_len=1024, prefix_cache_size=0))

    def run(name: str) -> tuple[float, list[list[int]]]:
        moe_experts.USE_GROUPED_MM_WITHOUT_AUTOGRAD, moe.DENSE_DECODE_MAX_ROWS = PATHS[name]
        started = time.thread_time()
        results = engine.generate(prompts, params)
        return time.thread_time() - started, [r.token_ids for r in results]

    best, tokens = dict.fromkeys(PATHS, float("inf")), {}
    for name in PATHS:
        run(name)  # warm-up
    for _ in range(args.repeats):
        for name in PATHS:
            seconds, tokens[name] = run(name)
            best[name] = min(best[name], seconds)
    baseline = best["dispatch+loop"]
    print(f"size={args.size} workload={args.workload} requests={len(prompts)} batch={args.batch} "
          f"(generated tokens per CPU-second, best of {args.repeats})")
    for name, seconds in best.items():
        same = tokens[name] == tokens["dispatch+loop"]
        print(f"{name:34s} {sum(p.max_tokens for p in params) / seconds:8.1f} tok/s  {baseline / seconds:5.2f}x  same tokens: {same}")


if __name__ == "__main__":
    main()
