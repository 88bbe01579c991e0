"""Command-line options shared by `manage.py pretrain`, `sft` and `rl` (argparse, no Django needed)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from training.train.loop import LoopConfig, OptimizerConfig


def add_loop_arguments(parser: argparse.ArgumentParser, *, steps: int, batch_size: int, lr: float) -> None:
    group = parser.add_argument_group("training loop")
    group.add_argument("--run-dir", required=True, help="Checkpoints and metrics go here; re-run to resume.")
    group.add_argument("--steps", type=int, default=steps, help="Optimizer steps of the whole run.")
    group.add_argument("--batch-size", type=int, default=batch_size, help="Sequences per step, all ranks.")
    group.add_argument("--micro-batch-size", type=int, default=None, help="Sequences per forward (default: per-rank batch).")
    group.add_argument("--lr", type=float, default=lr, help="Peak learning rate.")
    group.add_argument("--warmup-steps", type=int, default=10)
    group.add_argument("--weight-decay", type=float, default=0.1)
    group.add_argument("--grad-clip", type=float, default=1.0)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--checkpoint-every", type=int, default=50, help="0 saves only at the end.")
    group.add_argument("--keep-checkpoints", type=int, default=2)
    group.add_argument("--load-balancing-coef", type=float, default=0.01)
    group.add_argument("--router-z-coef", type=float, default=0.001)
    group.add_argument(
        "--expert-parallel", action="store_true", help="Split MoE experts across torchrun ranks (all-to-all)."
    )


def loop_config_from_options(options: dict[str, Any], *, world_size: int) -> LoopConfig:
    micro = options["micro_batch_size"] or max(1, options["batch_size"] // world_size)
    return LoopConfig(
        steps=options["steps"],
        batch_size=options["batch_size"],
        micro_batch_size=micro,
        seed=options["seed"],
        load_balancing_coef=options["load_balancing_coef"],
        router_z_coef=options["router_z_coef"],
        checkpoint_every=options["checkpoint_every"],
        keep_checkpoints=options["keep_checkpoints"],
        expert_parallel=options["expert_parallel"],
        optimizer=OptimizerConfig(
            lr=options["lr"],
            warmup_steps=options["warmup_steps"],
            weight_decay=options["weight_decay"],
            grad_clip=options["grad_clip"],
        ),
    )


def print_step(write: Callable[[str], None]) -> Callable[[dict[str, Any]], None]:
    """An on_step callback writing one JSON line per step (machine- and human-readable)."""

    def on_step(metrics: dict[str, Any]) -> None:
        write(json.dumps({key: round(value, 6) if isinstance(value, float) else value for key, value in metrics.items()}))

    return on_step
