"""Train/rollout logprob mismatch of the MoE policy, with and without routing replay.

Rollouts are sampled by the serving engine (KV cache, batched decode, per-token logprobs and the
experts every token was routed to); the trainer recomputes the same tokens' logprobs with a full
forward of identical weights. Numerical differences between the two paths flip near-tied router
decisions, which changes which experts run and hence the logprob. Routing replay feeds the
recorded experts to the training forward.

Printed per precision: mean and max |logp_train - logp_rollout| over sampled tokens with replay
(the figure) and without (the baseline, same tokens, same run), their ratio, and the fraction of
(token, layer) routing decisions on which the training forward disagrees with the rollout.

Run:  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_routing_replay.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import torch  # noqa: E402

from training.checkpoint import create_random_checkpoint, load_checkpoint  # noqa: E402
from training.serving import ChatModel  # noqa: E402
from training.train.rl import segment_logprobs, segments_to_batches  # noqa: E402
from training.train.rollouts import RolloutRecord, Segment  # noqa: E402

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Why does my unittest fail with ImportError when run from the tests folder?",
    "Fix the off-by-one error in range(len(items) - 1).",
    "Explain what a mixture-of-experts layer does.",
]


def measure(precision: str, *, completions: int, max_tokens: int, workdir: Path) -> dict[str, float]:
    checkpoint = create_random_checkpoint(workdir / precision, "tiny", seed=1, precision=precision)
    model, tokenizer, _ = load_checkpoint(checkpoint)
    chat_model = ChatModel(model, tokenizer, name=f"bench-{precision}")
    records = []
    try:
        for index in range(completions):
            messages = [{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}]
            completion = chat_model.complete(messages=messages, max_tokens=max_tokens, temperature=1.0, seed=index)
            segment = Segment(
                prompt_token_ids=completion.prompt_token_ids, token_ids=completion.token_ids,
                logprobs=completion.logprobs, routed_experts=completion.routed_experts,
            )
            records.append(RolloutRecord(task_id=f"p{index}", group=0, valid=True, reward=0.0, segments=[segment]))
    finally:
        chat_model.close()

    trainer, _, _ = load_checkpoint(checkpoint)
    advantages = torch.zeros(len(records))
    batches = segments_to_batches(records=records, advantages=advantages, micro_batch_size=1, pad_id=0, with_routing=True)
    gaps = {True: [], False: []}
    disagreements = decisions = 0
    with torch.no_grad():
        for batch in batches:
            mask = batch.loss_mask.bool()
            for replay in (True, False):
                logprobs = segment_logprobs(trainer, batch, temperature=1.0, routing_replay=replay)
                gaps[replay].append((logprobs - batch.behaviour_logprobs)[mask].abs())
            own = trainer(batch.input_ids, return_routing=True).routed_experts
            recorded = batch.routed_experts
            same = (own.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1)
            disagreements += int((~same).sum())
            decisions += same.numel()
    with_replay, without_replay = torch.cat(gaps[True]), torch.cat(gaps[False])
    return {
        "tokens": with_replay.numel(),
        "mean_with_replay": float(with_replay.mean()),
        "max_with_replay": float(with_replay.max()),
        "mean_without_replay": float(without_replay.mean()),
        "max_without_replay": float(without_replay.max()),
        "routing_disagreement": disagreements / max(decisions, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Fewer, shorter completions.")
    args = parser.parse_args()
    completions, max_tokens = (4, 32) if args.quick else (16, 96)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        for precision in ("fp32", "bf16", "mxfp8"):
            started = time.perf_counter()
            result = measure(precision, completions=completions, max_tokens=max_tokens, workdir=Path(directory))
            ratio = result["mean_without_replay"] / max(result["mean_with_replay"], 1e-12)
            print(
                f"{precision}: {result['tokens']} sampled tokens | mean |dlogp| with replay "
                f"{result['mean_with_replay']:.3e} (max {result['max_with_replay']:.3e}) | without replay "
                f"{result['mean_without_replay']:.3e} (max {result['max_without_replay']:.3e}) | "
                f"without/with = {ratio:.2f}x | routing decisions differing {100 * result['routing_disagreement']:.2f}% "
                f"| {time.perf_counter() - started:.1f}s"
            )


if __name__ == "__main__":
    main()
