"""Scheduler benchmark: continuous rollouts with bounded staleness vs synchronous batches.

Both modes run the same `RolloutScheduler` on the same number of equal workers (threads) and the
same heavy-tailed rollout durations (log-normal, seeded per rollout id, so both modes see identical
work), with a policy update that itself takes time. Printed: trained samples per second of each
mode, the continuous/synchronous throughput ratio, worker idle fraction and the staleness
histogram. Goal: ratio >= 3 and continuous idle <= 5 %.

    .venv/bin/python benchmarks/bench_scheduler.py [--workers 16] [--steps 60] [--sigma 1.5]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.rollout.scheduler import RolloutRequest, RolloutScheduler, SchedulerConfig


def rollout_duration(
    rollout_id: str, *, mean_s: float, sigma: float, replay: list[float] | None = None
) -> float:
    """Duration fixed by the rollout id (same in both modes): log-normal with the given mean, or a
    draw from replayed real rollout durations rescaled to that mean."""
    rng = random.Random(int(hashlib.sha256(rollout_id.encode()).hexdigest()[:16], 16))
    if replay:
        return rng.choice(replay) * mean_s / (sum(replay) / len(replay))
    mu = math.log(mean_s) - sigma**2 / 2
    return rng.lognormvariate(mu, sigma)


def replayed_durations(run_dir: str) -> list[float]:
    """Agent-loop durations of the rollouts a driver run recorded (RUN_DIR/traces/*.json)."""
    durations = []
    for path in sorted(Path(run_dir, "traces").glob("*.json")):
        value = json.loads(path.read_text()).get("duration_s")
        if value:
            durations.append(float(value))
    if not durations:
        raise SystemExit(f"no rollout traces with durations under {run_dir}/traces")
    return durations


def run_mode(*, max_staleness: int, args: argparse.Namespace) -> dict:
    config = SchedulerConfig(
        max_in_flight=args.workers,
        group_size=args.group_size,
        groups_per_step=args.workers // args.group_size,
        max_staleness=max_staleness,
    )
    workers = ThreadPoolExecutor(max_workers=args.workers)
    learner = ThreadPoolExecutor(max_workers=1)
    work_seconds = 0.0

    def execute(request: RolloutRequest, version: int) -> float:
        duration = rollout_duration(
            request.rollout_id, mean_s=args.mean_ms / 1000, sigma=args.sigma, replay=args.replay
        )
        time.sleep(duration)
        return duration

    def submit_rollout(request: RolloutRequest, version: int):
        return workers.submit(execute, request, version)

    def train(groups, version: int) -> int:
        nonlocal work_seconds
        work_seconds += sum(sample.result for group in groups for sample in group)
        time.sleep(args.update_ms / 1000)
        return version + 1

    def submit_update(groups, version: int):
        return learner.submit(train, groups, version)

    groups = ((f"step-task{index}", str(index)) for index in itertools.count())
    scheduler = RolloutScheduler(
        config=config, submit_rollout=submit_rollout, submit_update=submit_update, groups=groups
    )
    stats = scheduler.run(steps=args.steps)
    workers.shutdown(wait=False, cancel_futures=True)
    learner.shutdown(wait=True)
    capacity = args.workers * stats.wall_seconds
    return {
        "max_staleness": max_staleness,
        "wall_s": round(stats.wall_seconds, 3),
        "trained_samples": stats.accepted,
        "samples_per_s": round(stats.accepted / stats.wall_seconds, 2),
        "worker_idle_fraction": round(1 - min(1.0, stats.busy_seconds / capacity), 4),
        "dropped_stale": stats.dropped_stale,
        "staleness_histogram": dict(sorted(stats.staleness_histogram.items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=16, help="equal rollout workers in both modes")
    parser.add_argument("--group-size", type=int, default=4, help="rollouts per GRPO group")
    parser.add_argument("--steps", type=int, default=60, help="policy updates per mode")
    parser.add_argument("--mean-ms", type=float, default=40.0, help="mean rollout duration")
    parser.add_argument(
        "--sigma", type=float, default=1.5, help="log-normal shape (heavier tail when larger)"
    )
    parser.add_argument("--update-ms", type=float, default=20.0, help="duration of one policy update")
    parser.add_argument("--max-staleness", type=int, default=4, help="staleness bound of the continuous mode")
    parser.add_argument(
        "--replay-run-dir",
        default=None,
        help="replay rollout durations recorded by a driver run instead of log-normal",
    )
    args = parser.parse_args()
    args.replay = replayed_durations(args.replay_run_dir) if args.replay_run_dir else None
    if args.workers % args.group_size:
        parser.error("--workers must be a multiple of --group-size so a synchronous batch fills every worker")

    synchronous = run_mode(max_staleness=0, args=args)
    continuous = run_mode(max_staleness=args.max_staleness, args=args)
    ratio = continuous["samples_per_s"] / synchronous["samples_per_s"]
    report = {
        "workers": args.workers,
        "duration_distribution": (
            f"replayed from {len(args.replay)} rollouts of {args.replay_run_dir}, rescaled to mean {args.mean_ms}ms"
            if args.replay
            else f"lognormal(mean={args.mean_ms}ms, sigma={args.sigma})"
        ),
        "synchronous": synchronous,
        "continuous": continuous,
        "throughput_ratio_continuous_vs_synchronous": round(ratio, 2),
    }
    print(json.dumps(report, indent=2))
    print(
        f"continuous {continuous['samples_per_s']} samples/s vs synchronous {synchronous['samples_per_s']} "
        f"samples/s: {ratio:.2f}x; idle {continuous['worker_idle_fraction']:.1%} vs "
        f"{synchronous['worker_idle_fraction']:.1%}; max staleness seen "
        f"{max(continuous['staleness_histogram'], default=0)} (bound {args.max_staleness})"
    )


if __name__ == "__main__":
    main()
