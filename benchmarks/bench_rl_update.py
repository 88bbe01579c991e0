"""Time of one RL policy update's forward + backward, sampled-token outputs only vs the full forward.

`training.train.rl.segment_logprobs` asks the model for logits only at the loss positions (the tokens
the policy sampled) and so runs the last block only there (`MoETransformer.forward(logits_mask=...)`).
The baseline, measured in the same run on the same rows, is the plain forward over every position
followed by the same log-softmax, which is what the update did before. Both must give the same
gradient: the script prints their largest difference, so a wrong fast path cannot post a speed.

Rows are shaped like the toy tier's rollouts in the 60-minute learning runs: one merged row per rollout
of ~2,700 tokens (the 1.3k-token system prompt and tool preamble, the bug report, tool results) with
three sampled completions of ~100 tokens; 8 rows per update (the rollouts with a nonzero advantage in a
batch of 2 groups x 8). The model is `models/sft` when present (else a random tiny one, same shapes).

Run:  .venv/bin/python benchmarks/bench_rl_update.py [--rows 8] [--length 2700] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from training.checkpoint import create_random_checkpoint, load_checkpoint  # noqa: E402
from training.train.grpo import token_logprobs  # noqa: E402
from training.train.rl import TrainingSegments, segment_logprobs  # noqa: E402


def rollout_row(*, length: int, completion_tokens: int, n_experts: int, n_layers: int, top_k: int,
                generator: torch.Generator) -> TrainingSegments:
    input_ids = torch.randint(8, 2000, (1, length), generator=generator)
    targets = torch.randint(8, 2000, (1, length), generator=generator)
    loss_mask = torch.zeros(1, length)
    # three turns: after the prompt (~48 %), after a tool result (~70 %), at the end
    for start in (int(length * 0.48), int(length * 0.70), length - completion_tokens):
        loss_mask[0, start : start + completion_tokens] = 1.0
    routing = torch.randint(0, n_experts, (1, length, n_layers, top_k), generator=generator)
    return TrainingSegments(
        input_ids=input_ids, targets=targets, loss_mask=loss_mask, behaviour_logprobs=torch.zeros(1, length),
        advantages=torch.ones(1), routed_experts=routing,
    )


def full_forward_logprobs(model, batch: TrainingSegments, *, temperature: float, routing_replay: bool) -> torch.Tensor:
    logits = model(batch.input_ids, routing_override=batch.routed_experts if routing_replay else None).logits
    return token_logprobs(logits / temperature, batch.targets)


def update_pass(model, rows: list[TrainingSegments], logprobs_fn) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    for row in rows:
        logprobs = logprobs_fn(model, row, temperature=0.8, routing_replay=True)
        (-(logprobs * row.loss_mask).sum()).backward()
    seconds = time.perf_counter() - started
    gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return seconds, gradient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=2700)
    parser.add_argument("--completion-tokens", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    checkpoint = ROOT / "models" / "sft"
    workdir = None
    if not (checkpoint / "model.safetensors").exists():
        workdir = tempfile.TemporaryDirectory()
        checkpoint = create_random_checkpoint(Path(workdir.name), "tiny", seed=0, max_seq_len=args.length + 1)
    model, _, _ = load_checkpoint(checkpoint)
    model.train()
    config = model.config
    generator = torch.Generator().manual_seed(0)
    rows = [
        rollout_row(length=args.length, completion_tokens=args.completion_tokens, n_experts=config.n_experts,
                    n_layers=config.n_layers, top_k=config.top_k, generator=generator)
        for _ in range(args.rows)
    ]
    print(f"model {checkpoint.name if workdir is None else 'random tiny'}: {config.n_layers} layers, d_model "
          f"{config.d_model}, vocab {config.vocab_size}; {args.rows} rows x {args.length} tokens, "
          f"{int(rows[0].loss_mask.sum())} sampled tokens per row; torch threads {torch.get_num_threads()}")
    update_pass(model, rows[:1], full_forward_logprobs)  # warm-up
    update_pass(model, rows[:1], segment_logprobs)
    full_times, sampled_times = [], []
    for _ in range(args.repeats):
        seconds, full_gradient = update_pass(model, rows, full_forward_logprobs)
        full_times.append(seconds)
        seconds, sampled_gradient = update_pass(model, rows, segment_logprobs)
        sampled_times.append(seconds)
    difference = float((sampled_gradient - full_gradient).abs().max() / full_gradient.abs().max())
    full, sampled = statistics.median(full_times), statistics.median(sampled_times)
    print(f"  forward+backward per update: sampled-token outputs {sampled:.3f} s | baseline full forward "
          f"{full:.3f} s | speedup {full / sampled:.2f}x (median of {args.repeats})")
    print(f"  largest gradient difference, relative to the largest gradient entry: {difference:.1e}")
    if workdir is not None:
        workdir.cleanup()
    if difference > 1e-4:
        raise SystemExit("the sampled-token path does not reproduce the full forward's gradient")


if __name__ == "__main__":
    main()
