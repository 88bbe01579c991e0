"""Training throughput (forward + backward + AdamW step) of the policy model on this machine's CPU.

For each size, the MoE model is measured against the dense variant with the same active parameters per
token (d_ff = top_k * d_ff_expert), interleaved so background load hits both alike; the ratio is
MoE tokens/s over dense tokens/s. torch runs single-threaded and the rate is tokens per CPU-second of
the thread (CPU autograd runs on the calling thread), which other processes on a shared machine do not
inflate the way they inflate wall time.

    .venv/bin/python benchmarks/bench_model_training.py --sizes tiny small
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from training.model import ModelConfig, MoETransformer


def training_step_runner(config: ModelConfig, batch: int, seq_len: int, seed: int = 0):
    torch.manual_seed(seed)
    model = MoETransformer(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1))

    def step() -> float:
        out = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten())
        total = loss + 0.01 * out.load_balancing_loss + 0.001 * out.router_z_loss
        total.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per contender (best one is kept)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokens_per_step = args.batch * args.seq_len
    print(
        f"batch={args.batch} seq_len={args.seq_len} torch={torch.__version__} "
        f"(tokens per CPU-second of fwd+bwd+AdamW, best of {args.steps} steps)"
    )
    for size in args.sizes:
        moe_config = ModelConfig.named(size, max_seq_len=args.seq_len)
        dense_config = moe_config.dense_equivalent()
        runners = {
            "moe": training_step_runner(moe_config, args.batch, args.seq_len),
            "dense": training_step_runner(dense_config, args.batch, args.seq_len),
        }
        best = dict.fromkeys(runners, float("inf"))
        for run in runners.values():
            run()  # warm-up (allocator, optimizer state)
        for _ in range(args.steps):
            for name, run in runners.items():
                started = time.thread_time()
                run()
                best[name] = min(best[name], time.thread_time() - started)
        rates = {name: tokens_per_step / seconds for name, seconds in best.items()}
        counts = moe_config.parameter_counts()
        print(
            f"{size:6s} MoE   {rates['moe']:9.1f} tok/s  ({counts['total'] / 1e6:.2f}M total, "
            f"{counts['active'] / 1e6:.2f}M active, {moe_config.n_experts} experts top-{moe_config.top_k})"
        )
        print(
            f"{size:6s} dense {rates['dense']:9.1f} tok/s  ({dense_config.parameter_counts()['total'] / 1e6:.2f}M)"
            f"  -> MoE/dense = {rates['moe'] / rates['dense']:.2f}x"
        )


if __name__ == "__main__":
    main()
