"""Learning benchmark (slow, not CI): asynchronous GRPO on the toy tier from an SFT checkpoint.

Measures held-out pass@1 of the starting checkpoint (baseline) and of the trained one in the same
run, on the same held-out toy tasks and sampling settings, with 95 % intervals, and records the
training curves (reward, pass rate, tool calls per turn, staleness) from the driver's metrics.

    .venv/bin/python benchmarks/bench_learning.py --init-checkpoint var/runs/sft/checkpoints/step-00000100 \\
        --minutes 60 --heldout 100 --attempts 4 --run-dir var/runs/learning
    .venv/bin/python benchmarks/bench_learning.py --evaluate-only models/demo --disable-tools semantic_search
    .venv/bin/python benchmarks/bench_learning.py --evaluate-only var/ckpt/sft --output var/eval/sft.json
    .venv/bin/python benchmarks/bench_learning.py --compare var/eval/sft.json var/eval/rl.json

Goal: pass@1 after - before >= 15 points with the 95 % interval of the difference above zero (paired
over the held-out tasks, which both evaluations share; the unpaired interval of runs before stop 20 is
reported too),
within 60 minutes on the 2-core development machine. The final checkpoint is the one to ship as the
demo model (FLOWSTATE_MODEL_CHECKPOINT).

The lr decay (--min-lr-ratio, --lr-decay-fraction) follows the --minutes clock unless --max-updates is
given, so the run ends its decay when its hour does on a machine of any speed (2-core machines have made
289 to 870 updates an hour); --max-updates makes it count updates instead, as runs before stop 40 did.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.bench.runner import (
    BenchConfig,
    paired_pass_at_1_difference,
    paired_task_changes,
    run_benchmark,
    suite_tasks,
)
from training.rollout.driver import METRICS_FILE, AsyncRLConfig, read_jsonl, run_async_rl
from training.train.objective_options import ENTROPY_SCOPES
from training.train.state import latest_checkpoint

CURVE_KEYS = ("mean_reward", "pass_rate", "sampled_pass_rate", "abandoned_groups", "tool_calls_per_turn",
              "parallel_call_share", "staleness_mean", "mean_completion_tokens", "lr")
"""The driver's per-step metrics kept as curves in the report."""


def evaluate(checkpoint: str, args: argparse.Namespace, disable_tools: tuple[str, ...] = ()) -> dict:
    config = BenchConfig(
        disable_tools=disable_tools,
        suite=f"toy-{args.split}-{args.heldout}",
        policy=f"checkpoint:{checkpoint}",
        attempts=args.attempts,
        max_turns=args.max_turns,
        max_tokens_per_turn=args.max_tokens_per_turn,
        temperature=args.temperature,
        concurrency=2,
        copy_constraint=args.copy_constraint,
    )
    return run_benchmark(config=config)


def load_baseline(args: argparse.Namespace) -> dict:
    """A stored evaluation of the starting checkpoint, refused unless it used this run's settings."""
    summary = json.loads(Path(args.baseline).read_text())
    expected = {
        "suite": f"toy-heldout-{args.heldout}",
        "policy": f"checkpoint:{args.init_checkpoint}",
        "attempts": args.attempts,
        "max_turns": args.max_turns,
        "max_tokens_per_turn": args.max_tokens_per_turn,
        "temperature": args.temperature,
        "disable_tools": [],
        "copy_constraint": args.copy_constraint,
    }
    stored = {key: summary["config"].get(key) for key in expected}
    if stored != expected:
        raise SystemExit(
            f"--baseline {args.baseline} was evaluated with {stored}, this run needs {expected}; evaluate "
            "the starting checkpoint with these settings (--evaluate-only ... --output) or leave --baseline out"
        )
    return summary


def heldout_task_changes(before: dict, after: dict) -> dict:
    """`paired_task_changes` of two evaluations of the same suite, with the suite's bug kinds."""
    kinds = {task.task_id: task.mutation_kind for task in suite_tasks(after["config"]["suite"])}
    return paired_task_changes(before["per_task"], after["per_task"], kinds)


def print_task_changes(changes: dict) -> None:
    print(
        f"tasks up / down / same: {changes['up']} / {changes['down']} / {changes['same']}; all attempts passed "
        f"{changes['all_passed'][0]} -> {changes['all_passed'][1]}; none passed {changes['none_passed'][0]} -> "
        f"{changes['none_passed'][1]} ({changes['none_passed_in_both']} in both)"
    )
    for kind, row in changes["by_kind"].items():
        print(
            f"  {kind:<18} {row['tasks']:>3} tasks  pass@1 {row['pass_at_1'][0]:.2f} -> {row['pass_at_1'][1]:.2f}"
            f"  none passed in both: {row['none_passed_in_both']}"
        )


def unpaired_difference_interval(before: dict, after: dict) -> tuple[float, float, float]:
    """Difference of pass@1 and the 95 % interval of two independent binomial samples (tasks are the
    unit). Wider than the paired one; kept so that runs compare with those recorded before stop 20."""
    n0, n1 = before["scored_tasks"], after["scored_tasks"]
    p0, p1 = before["pass_at_1"] or 0.0, after["pass_at_1"] or 0.0
    standard_error = math.sqrt(p0 * (1 - p0) / max(n0, 1) + p1 * (1 - p1) / max(n1, 1))
    difference = p1 - p0
    return difference, difference - 1.96 * standard_error, difference + 1.96 * standard_error


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The run: checkpoint, budget, tasks, rollout and sampling settings."""
    parser.add_argument("--init-checkpoint", default=None, help="SFT checkpoint to start from (required)")
    parser.add_argument("--run-dir", default="var/runs/learning")
    parser.add_argument("--minutes", type=float, default=60.0, help="training wall-clock budget")
    parser.add_argument("--heldout", type=int, default=100, help="held-out toy tasks evaluated")
    parser.add_argument("--split", choices=("heldout", "validation"), default="heldout",
                        help="with --evaluate-only: 'validation' evaluates on toy-validation-N, held-out-split tasks "
                             "that toy-heldout-N never holds, to choose among checkpoints without touching the test")
    parser.add_argument("--attempts", type=int, default=4, help="attempts per held-out task")
    parser.add_argument("--tasks", type=int, default=256, help="training task pool")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--probe-size", type=int, default=0,
                        help="run this many rollouts of a group first and abandon the group if they all "
                             "earn the same reward (0 = run every group in full)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--inference-actors", type=int, default=1)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens-per-turn", type=int, default=AsyncRLConfig.max_tokens_per_turn)
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature of the held-out evaluations (and of the training rollouts "
                             "unless --rollout-temperature says otherwise)")
    parser.add_argument("--rollout-temperature", type=float, default=None,
                        help="sampling temperature of the training rollouts (default: --temperature); a hotter "
                             "one trains the policy to be good when sampled broadly, so it is sharper at --temperature")


def _add_objective_arguments(parser: argparse.ArgumentParser) -> None:
    """The update: learning rate and its schedule, the GRPO objective's options, rewards, decoding."""
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--warmup-steps", type=int, default=0, help="updates of linear learning-rate warmup")
    parser.add_argument("--max-updates", type=int, default=None,
                        help="stop after this many updates even within --minutes, and decay the lr by this "
                             "count (2-core machines made 289 to 870 per hour); unset, the decay follows the "
                             "--minutes clock instead (AsyncRLConfig.time_budget_minutes)")
    parser.add_argument("--min-lr-ratio", type=float, default=1.0,
                        help="lr at the end (--max-updates, or --minutes without it) as a fraction of --lr "
                             "(cosine decay; 1 keeps lr constant)")
    parser.add_argument("--lr-decay-fraction", type=float, default=1.0,
                        help="share of the updates after the warmup (of the --minutes budget, without "
                             "--max-updates) over which lr decays (0.25: the last quarter)")
    parser.add_argument("--gain-lr-scale", type=float, default=1.0,
                        help="learning-rate multiplier for normalisation gains (1-D parameters)")
    parser.add_argument("--negative-advantage-weight", type=float, default=1.0,
                        help="1 = GRPO; 0 = reinforce only rollouts that beat their group (RAFT-style)")
    parser.add_argument("--entropy-coef", type=float, default=0.0,
                        help="weight of the policy's token entropy in the update: > 0 bonus, < 0 sharpens")
    parser.add_argument("--entropy-scope", choices=ENTROPY_SCOPES, default="all",
                        help="rollouts the entropy term covers: all trained ones, or only those that beat their group")
    parser.add_argument("--kl-coef", type=float, default=0.0,
                        help="weight of the per-token KL penalty to the --init-checkpoint policy (0 = none)")
    parser.add_argument("--normalize-advantage-std", action="store_true",
                        help="divide each group's centred rewards by its standard deviation (the GRPO paper's form)")
    parser.add_argument("--expert-guidance", action="store_true",
                        help="when no rollout of a group passed, add the scripted expert's solution to the group")
    parser.add_argument("--reference-similarity-weight", type=float, default=0.0, metavar="W",
                        help="a failed training rollout scores W x its closest edit's similarity to the reference "
                        "fix (SWE-RL-style shaping; 0 keeps rewards test-only; held-out evaluation never uses it)")
    parser.add_argument("--no-copy-constraint", dest="copy_constraint", action="store_false",
                        help="sample edit_file's old_str freely instead of only from text of the tool results "
                             "(training.copy_constraint), in rollouts and evaluations")
    parser.add_argument("--free-rollouts", dest="rollout_copy_constraint", action="store_false",
                        help="sample old_str freely in the training rollouts only; evaluations keep the product's "
                             "constrained decoding unless --no-copy-constraint is given")
    parser.add_argument("--updates-per-step", type=int, default=1,
                        help="optimizer steps on each batch (later ones off-policy, clipped ratio)")


def _add_evaluation_arguments(parser: argparse.ArgumentParser) -> None:
    """Evaluation-only and comparison modes."""
    parser.add_argument("--evaluate-only", default=None, metavar="CHECKPOINT",
                        help="only evaluate CHECKPOINT on the held-out tasks (no training)")
    parser.add_argument("--disable-tools", default="",
                        help="with --evaluate-only: comma-separated tools refused when called")
    parser.add_argument("--output", default=None, metavar="JSON",
                        help="with --evaluate-only: also write the summary with its per-task rows here")
    parser.add_argument("--baseline", default=None, metavar="JSON",
                        help="an --evaluate-only --output file of --init-checkpoint with this run's settings, "
                             "used as the before figure instead of evaluating again (evaluation is seeded)")
    parser.add_argument("--compare", nargs=2, default=None, metavar=("BEFORE_JSON", "AFTER_JSON"),
                        help="paired pass@1 difference of two --output files (same suite and settings)")

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_run_arguments(parser)
    _add_objective_arguments(parser)
    _add_evaluation_arguments(parser)
    return parser


def compare(paths: list[str]) -> None:
    """--compare: the paired pass@1 difference of two --output files."""
    before, after = (json.loads(Path(path).read_text()) for path in paths)
    difference, low, high, tasks = paired_pass_at_1_difference(before["per_task"], after["per_task"])
    print(
        f"pass@1 {before['pass_at_1']:.3f} -> {after['pass_at_1']:.3f}: {100 * difference:+.1f} points, "
        f"paired 95% CI [{100 * low:+.1f}, {100 * high:+.1f}] over {tasks} tasks"
    )
    if "config" in after:
        print_task_changes(heldout_task_changes(before, after))
    else:
        print("no suite recorded in AFTER_JSON (not an --evaluate-only --output file): changes by bug kind left out")


def evaluate_checkpoint(args: argparse.Namespace) -> None:
    """--evaluate-only: one held-out evaluation of a finished checkpoint (e.g. the semantic_search ablation)."""
    disabled = tuple(name for name in args.disable_tools.split(",") if name)
    summary = evaluate(args.evaluate_only, args, disabled)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(summary, indent=2))
    summary.pop("per_task")
    print(json.dumps(summary, indent=2))


def rl_config(args: argparse.Namespace) -> AsyncRLConfig:
    """The driver's config for this run's arguments."""
    return AsyncRLConfig(
        run_dir=args.run_dir,
        init_checkpoint=args.init_checkpoint,
        steps=args.max_updates or 100_000,
        time_budget_minutes=None if args.max_updates is not None else args.minutes,
        tasks=args.tasks,
        group_size=args.group_size,
        groups_per_step=args.groups_per_step,
        max_staleness=args.max_staleness,
        probe_size=args.probe_size,
        rollout_workers=args.workers,
        inference_actors=args.inference_actors,
        max_turns=args.max_turns,
        max_tokens_per_turn=args.max_tokens_per_turn,
        temperature=args.temperature if args.rollout_temperature is None else args.rollout_temperature,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio,
        lr_decay_fraction=args.lr_decay_fraction,
        negative_advantage_weight=args.negative_advantage_weight,
        entropy_coef=args.entropy_coef,
        entropy_scope=args.entropy_scope,
        kl_coef=args.kl_coef,
        normalize_advantage_std=args.normalize_advantage_std,
        expert_guidance=args.expert_guidance,
        reference_similarity_weight=args.reference_similarity_weight,
        copy_constraint=args.copy_constraint and args.rollout_copy_constraint,
        gain_lr_scale=args.gain_lr_scale,
        updates_per_step=args.updates_per_step,
        keep_checkpoints=3,
    )


def train_and_evaluate(args: argparse.Namespace) -> dict:
    """Train for the budget, evaluate the final checkpoint (with and without semantic_search): the report."""
    started = time.monotonic()
    before = load_baseline(args) if args.baseline else evaluate(args.init_checkpoint, args)
    stop = threading.Event()
    # With --max-updates the schedule counts updates and this timer only stops the run; without it the
    # driver keeps the clock itself (time_budget_minutes), so its lr decay ends when the budget does.
    timer = threading.Timer(args.minutes * 60, stop.set)
    if args.max_updates is not None:
        timer.start()
    config = rl_config(args)
    training_started = time.monotonic()
    try:
        run_async_rl(config, stop=stop)
    finally:
        timer.cancel()
    training_minutes = (time.monotonic() - training_started) / 60
    final = latest_checkpoint(args.run_dir)
    after = evaluate(str(final), args) if final is not None else None
    # semantic_search stays in the prompt and is refused when called (removing it from the offer changes
    # the prompt, and the tiny model then stops calling tools at all: that measured the prompt, not the tool).
    after_without_search = evaluate(str(final), args, ("semantic_search",)) if final is not None else None
    metrics = read_jsonl(Path(args.run_dir) / METRICS_FILE)
    curves = {key: [[row["step"], row.get(key)] for row in metrics] for key in CURVE_KEYS}
    report = {
        "init_checkpoint": args.init_checkpoint,
        "final_checkpoint": str(final) if final else None,
        "training_minutes": round(training_minutes, 1),
        "rollout_temperature": config.temperature,
        "lr_schedule": "updates" if config.time_budget_minutes is None else f"clock ({config.time_budget_minutes} min)",
        "reference_similarity_weight": config.reference_similarity_weight,
        "rollout_copy_constraint": config.copy_constraint,
        "evaluation_copy_constraint": args.copy_constraint,
        "evaluation_temperature": args.temperature,
        "steps": len(metrics),
        "heldout_before": before,
        "heldout_after": after,
        "heldout_after_without_semantic_search": after_without_search,
        "curves": curves,
        "total_minutes": round((time.monotonic() - started) / 60, 1),
    }
    if after is not None:
        difference, low, high, paired_tasks = paired_pass_at_1_difference(before["per_task"], after["per_task"])
        report["pass_at_1_gain_points"] = round(100 * difference, 1)
        report["pass_at_1_gain_ci95_points"] = [round(100 * low, 1), round(100 * high, 1)]
        report["pass_at_1_gain_paired_tasks"] = paired_tasks
        _, low, high = unpaired_difference_interval(before, after)
        report["pass_at_1_gain_unpaired_ci95_points"] = [round(100 * low, 1), round(100 * high, 1)]
        report["heldout_task_changes"] = heldout_task_changes(before, after)
    return report


def report_write_and_print(args: argparse.Namespace, report: dict) -> None:
    """RUN_DIR/learning_report.json, and the figures on the console."""
    Path(args.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.run_dir) / "learning_report.json").write_text(json.dumps(report, indent=2))
    # Per-task rows and curves stay in the file; the console gets the figures.
    printed = {key: value for key, value in report.items() if key not in ("curves", "heldout_task_changes")}
    for key in ("heldout_before", "heldout_after", "heldout_after_without_semantic_search"):
        if printed[key] is not None:
            printed[key] = {k: v for k, v in printed[key].items() if k != "per_task"}
    print(json.dumps(printed, indent=2))
    before, after = report["heldout_before"], report["heldout_after"]
    if after is not None:
        print(
            f"held-out pass@1 {before['pass_at_1']:.3f} -> {after['pass_at_1']:.3f} "
            f"({report['pass_at_1_gain_points']:+.1f} points, paired 95% CI {report['pass_at_1_gain_ci95_points']} "
            f"over {report['pass_at_1_gain_paired_tasks']} tasks; unpaired {report['pass_at_1_gain_unpaired_ci95_points']}) "
            f"after {report['training_minutes']:.1f} min / {report['steps']} steps; ratio after/before "
            f"{(after['pass_at_1'] or 0) / max(before['pass_at_1'] or 0, 1e-9):.2f}"
        )
        print_task_changes(report["heldout_task_changes"])
    else:
        print("no training step finished within the budget: nothing to evaluate")


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.compare:
        compare(args.compare)
        return
    if args.init_checkpoint is None and args.evaluate_only is None:
        # `make bench` runs every script; this one needs an SFT checkpoint and an hour, so it says how.
        print(
            "bench_learning: not run. It needs an SFT checkpoint and ~60 minutes: "
            "benchmarks/bench_learning.py --init-checkpoint PATH [--minutes 60]"
        )
        return
    if args.split != "heldout" and not args.evaluate_only:
        parser.error("--split validation needs --evaluate-only: a learning run's before/after is the held-out test")
    if not args.evaluate_only and args.heldout < 2:
        # Said now rather than after the training budget: the before/after comparison is a paired interval.
        parser.error(f"--heldout {args.heldout}: the paired interval of the gain needs at least 2 held-out tasks")
    if args.evaluate_only:
        evaluate_checkpoint(args)
        return
    report_write_and_print(args, train_and_evaluate(args))


if __name__ == "__main__":
    main()
