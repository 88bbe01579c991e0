"""One GRPO update of an imported tiny Qwen3-MoE through the Learner: fp32 experts vs MXFP8 experts, same run.

    .venv/bin/python benchmarks/bench_hf_rl_update.py [--rollouts 4] [--tokens 32] [--repeats 3]

Builds the tests' tiny imported policy (tests/training/hf/policy_models.py: d_model 64, 4 experts of width 32,
a BPE tokenizer and Qwen2.5's template), samples real rollouts of toy tasks in local sandboxes with the served
model (its own template), gives the groups differing rewards, and times Learner.update (routing replay on)
for each precision on the same records. Prints seconds per update and trained tokens per second; on a CPU the
MXFP8 path runs the reference (emulated) kernels, so the ratio measures the emulation, not FP8 hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts (2 per task)")
    parser.add_argument("--tokens", type=int, default=32, help="completion tokens per rollout")
    parser.add_argument("--repeats", type=int, default=3, help="updates timed per precision")
    args = parser.parse_args()

    import torch

    from sandboxes import get_backend
    from tests.training.hf.policy_models import save_policy_directory
    from training.agent.config import AgentLimits
    from training.checkpoint import load_checkpoint
    from training.serving import ChatModel
    from training.tasks.toy import generate_toy_task
    from training.train.learner import Learner
    from training.train.loop import OptimizerConfig
    from training.train.rl import RLConfig
    from training.train.rollouts import rollouts_collect

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-hf-rl-"))
    policy = root / "policy"
    save_policy_directory(policy)
    limits = AgentLimits(max_turns=1, max_tokens=4 * args.tokens, max_tokens_per_turn=args.tokens,
                         context_tokens=8192, temperature=1.0)
    model, tokenizer, _ = load_checkpoint(policy)
    chat_model = ChatModel.for_policy(model, tokenizer, name="bench")
    started = time.perf_counter()
    try:
        records = rollouts_collect(
            tasks=[generate_toy_task(i) for i in range(args.rollouts // 2)], group_size=2,
            backend=get_backend("local"), chat_model=chat_model, limits=limits, seed=3,
        )
    finally:
        chat_model.close()
    print(f"rollouts: {len(records)} in {time.perf_counter() - started:.1f} s, "
          f"prompt {len(records[0].segments[0].prompt_token_ids)} tokens each")
    records = [dataclasses.replace(r, reward=float(i % 2)) for i, r in enumerate(records)]
    for precision in ("fp32", "mxfp8"):
        config = RLConfig(run_dir=str(root / precision), init_checkpoint=str(policy), tasks=len(records) // 2,
                          tasks_per_step=len(records) // 2, group_size=2, precision=precision,
                          optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0))
        learner = Learner(config)
        learner.restore(root / precision)
        times, tokens, mismatch = [], 0, None
        for _ in range(args.repeats):
            result = learner.update(records)
            times.append(result.seconds)
            tokens = result.stats["trained_tokens"]
            mismatch = result.stats["logprob_mismatch"] if mismatch is None else mismatch
        best = min(times)
        print(f"{precision}: update {best:.2f} s (best of {args.repeats}; all {[round(t, 2) for t in times]}), "
              f"{tokens} trained tokens, {tokens / best:.0f} trained tok/s, first update's logprob mismatch "
              f"{mismatch:.2e} (rollouts sampled with fp32 experts)")


if __name__ == "__main__":
    main()
