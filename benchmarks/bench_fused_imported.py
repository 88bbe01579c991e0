"""Imported MoE families: the engine with and without the fused decode path, interleaved in one process.

Each round runs the same 8 requests (prompts 8-96 tokens, 24 tokens each, batch 8) once fused and once
unfused, alternating, so load changes on a shared machine hit both alike; medians are printed.

    .venv/bin/python benchmarks/bench_fused_imported.py [--families olmoe,qwen3_moe] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_hf_engine import SIZE, imported_pair, run_engine, workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="olmoe,qwen3_moe")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for family in args.families.split(","):
        _, model = imported_pair(family)
        pairs = [(prompt, 24) for prompt, _ in workload(SIZE["vocab_size"], requests=8)]
        tokens = sum(n for _, n in pairs)
        run_engine(model, pairs[:2], 8)  # warm-up
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for fused in (True, False):
                times[fused].append(run_engine(model, pairs, 8, fused=fused))
        fused_s, unfused_s = statistics.median(times[True]), statistics.median(times[False])
        print(f"{family}: fused {tokens / fused_s:.1f} tok/s, unfused {tokens / unfused_s:.1f} tok/s, "
              f"fused speed-up {unfused_s / fused_s:.2f}x (medians of {args.rounds}; fused rounds "
              f"{[round(t, 2) for t in times[True]]} s, unfused {[round(t, 2) for t in times[False]]} s)", flush=True)


if __name__ == "__main__":
    main()
