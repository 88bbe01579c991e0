"""Time of one RL policy update when a group's rollouts run their shared prefix once, vs once per rollout.

Every rollout of a GRPO group starts with the same tokens: the system prompt, the tool schemas and the
task. `training.train.rl.policy_updates(share_prefixes=True)` runs that prefix once per update
(`MoETransformer.prefix_forward`), attends it from each rollout's own tokens, and sends the rollouts'
gradients through it in one backward pass. The baseline, measured in the same run on the same rows, is
the same update with every row run in full (`share_prefixes=False`, what the learner did before stop 40).
Both must move the weights the same way: the update is plain SGD, and the script prints the largest
difference of the two weight changes, so a wrong fast path cannot post a speed.

Rows are shaped like the toy tier's rollouts in the 60-minute learning runs: one group of 16 rollouts per
update, one merged row each of ~2,600 tokens whose first ~1,450 (system prompt, tool preamble, bug
report) every rollout of the group shares, three sampled completions of ~90 tokens, and the routing the
rollouts recorded (replayed by the learner). The model is `models/sft` when present (else a random tiny
one, same shapes).

Run:  .venv/bin/python benchmarks/bench_shared_prefix.py [--rows 16] [--prefix 1450] [--length 2600] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from training.checkpoint import create_random_checkpoint, load_checkpoint  # noqa: E402
from training.train.grpo import GRPOConfig  # noqa: E402
from training.train.rl import RLConfig, TrainingSegments, policy_updates, shared_prefix_groups  # noqa: E402


def group_rows(*, rows: int, prefix: int, length: int, completion_tokens: int, config, generator) -> list[TrainingSegments]:
    shared_tokens = torch.randint(8, 2000, (1, prefix), generator=generator)
    shared_routing = torch.randint(0, config.n_experts, (1, prefix, config.n_layers, config.top_k), generator=generator)
    batches = []
    for index in range(rows):
        input_ids = torch.cat([shared_tokens, torch.randint(8, 2000, (1, length - prefix), generator=generator)], dim=1)
        routing = torch.cat(
            [shared_routing,
             torch.randint(0, config.n_experts, (1, length - prefix, config.n_layers, config.top_k), generator=generator)],
            dim=1,
        )
        loss_mask = torch.zeros(1, length)
        # three turns: right after the shared prompt, after a tool result, at the end
        for start in (prefix, prefix + (length - prefix) // 2, length - completion_tokens):
            loss_mask[0, start : start + completion_tokens] = 1.0
        batches.append(
            TrainingSegments(
                input_ids=input_ids, targets=torch.randint(8, 2000, (1, length), generator=generator),
                loss_mask=loss_mask, behaviour_logprobs=torch.full((1, length), -2.0) * loss_mask,
                advantages=torch.tensor([0.5 if index % 2 else -0.5]), routed_experts=routing,
            )
        )
    return batches


def update(model, batches, config: RLConfig, *, share: bool) -> tuple[float, torch.Tensor]:
    policy = copy.deepcopy(model)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    started = time.perf_counter()
    policy_updates(model=policy, optimizer=optimizer, batches=batches, config=config, share_prefixes=share)
    seconds = time.perf_counter() - started
    with torch.no_grad():
        delta = torch.cat([(after - before).flatten() for after, before in zip(policy.parameters(), model.parameters(), strict=True)])
    return seconds, delta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=1450)
    parser.add_argument("--length", type=int, default=2600)
    parser.add_argument("--completion-tokens", type=int, default=90)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not 0 < args.prefix < args.length - 3 * args.completion_tokens:
        parser.error("--prefix must be positive and leave room for three completions within --length")

    checkpoint = ROOT / "models" / "sft"
    workdir = None
    if not (checkpoint / "model.safetensors").exists():
        workdir = tempfile.TemporaryDirectory()
        checkpoint = create_random_checkpoint(Path(workdir.name), "tiny", seed=0, max_seq_len=args.length + 1)
    model, _, _ = load_checkpoint(checkpoint)
    model.train()
    generator = torch.Generator().manual_seed(0)
    batches = group_rows(rows=args.rows, prefix=args.prefix, length=args.length,
                         completion_tokens=args.completion_tokens, config=model.config, generator=generator)
    config = RLConfig(run_dir=tempfile.gettempdir(), init_checkpoint=str(checkpoint), temperature=1.4,
                      grpo=GRPOConfig(entropy_coef=-0.5, entropy_scope="positive"))
    groups = shared_prefix_groups(batches, routing_replay=True)
    print(f"model {checkpoint.name if workdir is None else 'random tiny'}: {model.config.n_layers} layers, d_model "
          f"{model.config.d_model}; {args.rows} rows x {args.length} tokens, shared prefix {groups[0][0]} tokens "
          f"({len(groups)} prefix group(s)); torch threads {torch.get_num_threads()}")
    update(model, batches[:2], config, share=False)  # warm-up
    update(model, batches[:2], config, share=True)
    full_times, shared_times = [], []
    for _ in range(args.repeats):
        seconds, full_delta = update(model, batches, config, share=False)
        full_times.append(seconds)
        seconds, shared_delta = update(model, batches, config, share=True)
        shared_times.append(seconds)
    difference = float((shared_delta - full_delta).abs().max() / full_delta.abs().max())
    full, shared = statistics.median(full_times), statistics.median(shared_times)
    print(f"  policy update (forward + backward + step): shared prefix {shared:.3f} s | baseline every row in full "
          f"{full:.3f} s | speedup {full / shared:.2f}x (median of {args.repeats})")
    print(f"  largest weight-change difference, relative to the largest change: {difference:.1e}")
    if workdir is not None:
        workdir.cleanup()
    if difference > 1e-3:
        raise SystemExit("the shared-prefix update does not reproduce the full update")


if __name__ == "__main__":
    main()
