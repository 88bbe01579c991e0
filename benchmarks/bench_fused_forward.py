"""Generation A/B of the engine's fused inference forward against MoETransformer.forward, in one process.

Both engines run the same requests on the same model; "reference" is ``EngineConfig(fused_forward=False)``
(the model's own forward over the KV cache), "fused" the default (``training/model/fused_forward.py``).
Rates are generated tokens per CPU-second of the benchmark thread, best of N, contenders interleaved;
tokens must be identical and logprobs equal within float rounding.

    .venv/bin/python benchmarks/bench_fused_forward.py --size tiny --workload uniform
    .venv/bin/python benchmarks/bench_fused_forward.py --size tiny --workload mixed
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.generation_workload import decode_workload
from training.engine import EngineConfig, GenerationEngine, GenerationResult


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size", default="tiny", help='ModelConfig.named preset, e.g. "tiny" or "small-dense"'
    )
    parser.add_argument("--workload", choices=("uniform", "mixed"), default="uniform")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, prompts, params = decode_workload(
        size=args.size, workload=args.workload, batch=args.batch, temperature=args.temperature
    )
    engines = {
        name: GenerationEngine(
            model, config=EngineConfig(max_batch_size=args.batch, max_seq_len=1024, fused_forward=fused, prefix_cache_size=0)
        )
        for name, fused in (("reference", False), ("fused", True))
    }
    best = dict.fromkeys(engines, float("inf"))
    results: dict[str, list[GenerationResult]] = {}
    for engine in engines.values():
        engine.generate(prompts, params)  # warm-up
    for _ in range(args.repeats):
        for name, engine in engines.items():
            started = time.thread_time()
            results[name] = engine.generate(prompts, params)
            best[name] = min(best[name], time.thread_time() - started)

    reference, fused = results["reference"], results["fused"]
    same_tokens = [r.token_ids for r in reference] == [f.token_ids for f in fused]
    logprob_gap = max(
        abs(a - b) for r, f in zip(reference, fused, strict=True) for a, b in zip(r.logprobs, f.logprobs, strict=False)
    )
    print(
        f"size={args.size} workload={args.workload} requests={len(prompts)} batch={args.batch} "
        f"temperature={args.temperature} (generated tokens per CPU-second, best of {args.repeats})"
    )
    for name, seconds in best.items():
        print(f"{name:10s} {sum(p.max_tokens for p in params) / seconds:8.1f} tok/s  {best['reference'] / seconds:5.2f}x")
    print(f"same tokens: {same_tokens}, largest logprob difference: {logprob_gap:.2e}")


if __name__ == "__main__":
    main()
