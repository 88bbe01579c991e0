"""Is the RL worth it? RL against more SFT at equal CPU time from models/sft, and RL's spread over seeds (issue 50).

Recipes (training.bench.recipes), each given the same wall-clock budget on this machine, back to back:
(a) ``rl`` the documented asynchronous GRPO recipe, (b) ``expert-sft`` SFT on fresh scripted-expert
trajectories, (c) ``rft`` rejection-sampling fine-tuning on the policy's own passing rollouts. Then
held-out pass@1 and pass@k (--heldout tasks x --attempts) of the start and of every recipe's final
checkpoint, with paired bootstrap intervals (and McNemar's exact test of pass@k) of every pair, and
held-out pass@1 of each recipe's curve checkpoints against its minutes (--curve-heldout tasks, one
attempt each). Writes RUN_DIR/recipes_report.json (seeds_report.json with --seeds) and the plot as SVG
(recipes_heldout_pass_at_1.svg / seeds_heldout_pass_at_1.svg); each recipe's checkpoints, curve checkpoints,
recipe.json and rows.jsonl are under RUN_DIR/<recipe>-seed<N>/.

    # the measurement (a quiet machine; ~3 x 60 min + evaluations, then 2 x 60 min more for the seeds,
    # seed 0's RL run reused; docs/notebook/2026-11-29c-issue-50.md has the full sequence):
    .venv/bin/python benchmarks/bench_rl_vs_sft.py --minutes 60 --seed 0 --run-dir var/runs/rl-vs-sft
    .venv/bin/python benchmarks/bench_rl_vs_sft.py --minutes 60 --seeds 0 1 2 --reuse-finished --run-dir var/runs/rl-vs-sft
    # a smoke run (figures of no meaning): every stage at a tiny budget
    .venv/bin/python benchmarks/bench_rl_vs_sft.py --minutes 3 --heldout 10 --attempts 2 --curve-points 2 \\
        --curve-heldout 5 --run-dir var/runs/rl-vs-sft-smoke

--record-owner USER (with --record-team TEAM) stores each recipe as a finished experiment of USER (its
step rows, held-out pass@1 at the curve points, the minutes of every step), so the experiments page's
comparison view plots the recipes side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.bench.paired import PairedDifference, paired_comparison
from training.bench.recipes import (
    RECIPES,
    RecipeConfig,
    RecipeRun,
    recipe_load,
    recipe_save,
    rl_config,
    run_recipe,
)
from training.bench.runner import BenchConfig, run_benchmark
from training.bench.svg_plot import line_plot_svg


@dataclass
class Evaluation:
    """One checkpoint's held-out evaluation."""

    name: str
    """"start" or a recipe name."""

    checkpoint: str
    """The evaluated checkpoint."""

    pass_at_1: float | None
    """Held-out pass@1."""

    pass_at_k: float | None
    """Held-out pass@k (k = attempts)."""

    per_task: list[dict] = field(repr=False, default_factory=list)
    """run_benchmark's per-task rows (the pairing unit)."""


@dataclass
class RecipeResult:
    """A recipe's run, its final evaluation and its curve."""

    recipe: str
    """Recipe name."""

    seed: int
    """Its seed."""

    minutes: float
    """Wall-clock minutes it ran."""

    steps: int
    """Optimizer steps."""

    final: Evaluation
    """Held-out evaluation of the final checkpoint."""

    curve: list[list[float]]
    """[minutes, held-out pass@1 on the curve suite] from the start (minute 0) to the end."""

    data: dict = field(default_factory=dict)
    """Data the recipe generated."""


@dataclass
class SeedSpread:
    """Held-out figures of one recipe over several seeds."""

    recipe: str
    """Recipe name."""

    seeds: list[int]
    """Seeds run."""

    pass_at_1: list[float]
    """Final held-out pass@1 per seed."""

    pass_at_k: list[float]
    """Final held-out pass@k per seed."""

    mean_pass_at_1: float
    """Mean over the seeds."""

    sd_pass_at_1: float
    """Sample standard deviation over the seeds (0 with one seed)."""

    worst_pass_at_1: float
    """Lowest pass@1 of any seed."""

    mean_pass_at_k: float
    """Mean pass@k over the seeds."""


def evaluate(checkpoint: str, args: argparse.Namespace, *, tasks: int, attempts: int) -> dict:
    config = BenchConfig(
        suite=f"toy-heldout-{tasks}", policy=f"checkpoint:{checkpoint}", attempts=attempts, max_turns=args.max_turns,
        max_tokens_per_turn=args.max_tokens_per_turn, temperature=args.temperature, concurrency=2,
        copy_constraint=True,
    )
    return run_benchmark(config=config)


def final_evaluation(name: str, checkpoint: str, args: argparse.Namespace) -> Evaluation:
    summary = evaluate(checkpoint, args, tasks=args.heldout, attempts=args.attempts)
    return Evaluation(name=name, checkpoint=checkpoint, pass_at_1=summary["pass_at_1"],
                      pass_at_k=summary["pass_at_k"], per_task=summary["per_task"])


def start_evaluation(args: argparse.Namespace) -> Evaluation:
    """The start's evaluation: a stored one (--baseline, refused unless its settings are this run's) or a new one."""
    if not args.baseline:
        return final_evaluation("start", args.init_checkpoint, args)
    summary = json.loads(Path(args.baseline).read_text())
    expected = {"suite": f"toy-heldout-{args.heldout}", "policy": f"checkpoint:{args.init_checkpoint}",
                "attempts": args.attempts, "max_turns": args.max_turns, "temperature": args.temperature,
                "max_tokens_per_turn": args.max_tokens_per_turn, "copy_constraint": True}
    stored = {key: summary["config"].get(key) for key in expected}
    if stored != expected:
        raise SystemExit(f"--baseline {args.baseline} was evaluated with {stored}; this run needs {expected}")
    return Evaluation(name="start", checkpoint=args.init_checkpoint, pass_at_1=summary["pass_at_1"],
                      pass_at_k=summary["pass_at_k"], per_task=summary["per_task"])


def recipe_config(recipe: str, seed: int, args: argparse.Namespace) -> RecipeConfig:
    return RecipeConfig(
        recipe=recipe, init_checkpoint=args.init_checkpoint, run_dir=str(Path(args.run_dir) / f"{recipe}-seed{seed}"),
        minutes=args.minutes, seed=seed, curve_points=args.curve_points, max_turns=args.max_turns,
        workers=args.workers, rl_options=json.loads(args.rl_options), sft_lr=args.sft_lr,
    )


def run_and_evaluate(recipe: str, seed: int, args: argparse.Namespace, start_curve: float | None) -> tuple:
    """Run one recipe, evaluate its final checkpoint and its curve points; returns (RecipeResult, RecipeRun)."""
    config = recipe_config(recipe, seed, args)
    run = recipe_load(config) if args.reuse_finished else None
    if run is None:
        run = run_recipe(config)
        recipe_save(run)
    else:
        print(f"{recipe} seed {seed}: reusing the finished run in {config.run_dir} (not recorded again)")
        args.reused.add(config.run_dir)
    final = final_evaluation(recipe, run.final_checkpoint, args)
    curve = [[0.0, start_curve]] if start_curve is not None else []
    for point in run.curve:
        if args.curve_heldout:
            summary = evaluate(point.checkpoint, args, tasks=args.curve_heldout, attempts=1)
            point.pass_at_1 = summary["pass_at_1"]
            curve.append([round(point.minutes, 2), point.pass_at_1])
    result = RecipeResult(recipe=recipe, seed=seed, minutes=round(run.minutes, 2), steps=run.steps, final=final,
                          curve=curve, data=run.data)
    result_save(result, Path(config.run_dir) / "result.json", args)
    return result, run


EVALUATION_SETTINGS = ("init_checkpoint", "minutes", "heldout", "attempts", "curve_heldout", "max_turns",
                       "max_tokens_per_turn", "temperature")
"""Settings two recipe results must share to be compared (--combine refuses results that differ in one)."""


def result_save(result: RecipeResult, path: Path, args: argparse.Namespace) -> None:
    """One recipe's result with its per-task rows, written as soon as it is evaluated (so --combine can pair it
    with recipes run later, in another process or on another day)."""
    settings = {key: getattr(args, key) for key in EVALUATION_SETTINGS}
    payload = {"settings": settings, "machine": machine_line(), "result": asdict(result)}
    path.write_text(json.dumps(payload, indent=2, default=str))


def result_load(path: Path, args: argparse.Namespace) -> RecipeResult:
    """A result.json of result_save, refused (SystemExit naming the setting) unless evaluated with this run's settings."""
    payload = json.loads(path.read_text())
    expected = {key: getattr(args, key) for key in EVALUATION_SETTINGS}
    stored = payload.get("settings", {})
    differing = {key: (stored.get(key), value) for key, value in expected.items() if stored.get(key) != value}
    if differing:
        raise SystemExit(f"--combine {path}: settings differ from this run's (stored, this run): {differing}")
    fields = dict(payload["result"])
    fields["final"] = Evaluation(**fields["final"])
    return RecipeResult(**fields)


def machine_line() -> str:
    """What the figures were measured on: host name, CPUs, load average when written."""
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    return f"{os.uname().nodename}, {os.cpu_count()} CPUs, load {load}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"


def comparisons(evaluations: list[Evaluation], args: argparse.Namespace) -> list[dict]:
    """Every pair (A, B) in order: B - A with paired bootstrap intervals over the shared tasks."""
    rows = []
    for i, a in enumerate(evaluations):
        for b in evaluations[i + 1 :]:
            differences: list[PairedDifference] = paired_comparison(
                a.per_task, b.per_task, k=args.attempts, resamples=args.resamples, seed=args.seed)
            rows.append({"a": a.name, "b": b.name, "differences": [asdict(d) for d in differences]})
    return rows


def seed_spread(recipe: str, results: list[RecipeResult]) -> SeedSpread:
    ones = [result.final.pass_at_1 or 0.0 for result in results]
    ks = [result.final.pass_at_k or 0.0 for result in results]
    return SeedSpread(recipe=recipe, seeds=[result.seed for result in results], pass_at_1=ones, pass_at_k=ks,
                      mean_pass_at_1=statistics.fmean(ones), sd_pass_at_1=statistics.stdev(ones) if len(ones) > 1 else 0.0,
                      worst_pass_at_1=min(ones), mean_pass_at_k=statistics.fmean(ks))


def record_experiments(runs: list[tuple[RecipeResult, RecipeRun]], args: argparse.Namespace) -> list[int]:
    """Each recipe as a finished experiment of --record-owner (needs the web app's database)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model

    from webapp.experiments.services import experiment_record

    owner = get_user_model().objects.get(username=args.record_owner)
    team = owner.teams.get(name=args.record_team) if args.record_team else None
    ids = []
    for result, run in runs:
        if run.config.run_dir in args.reused:
            continue
        rows = [dict(row) for row in run.rows]
        by_step = {point.step: point for point in run.curve if point.pass_at_1 is not None}
        for row in rows:
            if row["step"] in by_step:
                row["heldout_pass_at_1"] = by_step[row["step"]].pass_at_1
        config = {"recipe": result.recipe, **{k: v for k, v in asdict(run.config).items() if k != "recipe"},
                  "steps": run.steps}
        if result.recipe == "rl":  # the driver's full config, so the comparison lists what differs from it
            config["rl"] = json.loads(json.dumps(asdict(rl_config(run.config)), default=str))
        experiment = experiment_record(
            owner=owner, team=team, name=f"{result.recipe} seed {result.seed} ({args.minutes:g} min)", config=config,
            steps=rows, run_dir=run.config.run_dir, checkpoints=[(run.steps, run.final_checkpoint)] if run.steps else [],
            status_reason=f"recorded by benchmarks/bench_rl_vs_sft.py; final held-out pass@1 {result.final.pass_at_1}",
        )
        ids.append(experiment.pk)
    return ids


def plot(results: list[RecipeResult], path: Path, args: argparse.Namespace) -> None:
    series = {f"{result.recipe} (seed {result.seed})": result.curve for result in results if result.curve}
    path.write_text(line_plot_svg(
        series, title=f"held-out pass@1 ({args.curve_heldout} tasks x 1) against minutes from {args.init_checkpoint}",
        x_label="minutes of the recipe (wall-clock, same machine)", y_label="held-out pass@1"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init-checkpoint", default="models/sft", help="checkpoint every recipe starts from")
    parser.add_argument("--run-dir", default="var/runs/rl-vs-sft")
    parser.add_argument("--minutes", type=float, default=60.0, help="wall-clock budget of each recipe")
    parser.add_argument("--seed", type=int, default=0, help="seed of the recipes (and of the bootstrap)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="run the RL recipe once per seed (no SFT recipes) and report mean, spread and worst")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--heldout", type=int, default=100, help="held-out tasks of the final evaluations")
    parser.add_argument("--attempts", type=int, default=4, help="attempts per held-out task (pass@k: k = this)")
    parser.add_argument("--curve-points", type=int, default=4, help="checkpoints per recipe on the curve")
    parser.add_argument("--curve-heldout", type=int, default=50,
                        help="held-out tasks (one attempt) each curve checkpoint is evaluated on (0: no curve)")
    parser.add_argument("--baseline", default=None, metavar="JSON",
                        help="bench_learning.py --evaluate-only --output file of --init-checkpoint with these settings")
    parser.add_argument("--max-turns", type=int, default=5)
    parser.add_argument("--max-tokens-per-turn", type=int, default=None, help="default: AsyncRLConfig's")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of the evaluations")
    parser.add_argument("--workers", type=int, default=4, help="sandboxes at once while an SFT recipe makes data")
    parser.add_argument("--sft-lr", type=float, default=RecipeConfig.sft_lr,
                        help="lr of the SFT recipes (after a 10-step warmup, constant)")
    parser.add_argument("--rl-options", default="{}", help='JSON of AsyncRLConfig overrides, e.g. {"rollout_workers": 2}')
    parser.add_argument("--reuse-finished", action="store_true",
                        help="a recipe whose run directory already holds a finished run with these settings is "
                             "evaluated again, not rerun (e.g. --seeds 0 1 2 after the three-recipe run, same --run-dir)")
    parser.add_argument("--combine", nargs="+", default=None, metavar="RESULT_JSON",
                        help="run nothing: compare the start (--baseline) with these recipes' result.json files, "
                             "written by earlier runs with the same evaluation settings")
    parser.add_argument("--resamples", type=int, default=10_000, help="paired bootstrap resamples")
    parser.add_argument("--record-owner", default=None, help="store each recipe as a finished experiment of this user")
    parser.add_argument("--record-team", default=None, help="with --record-owner: share them with this team of theirs")
    args = parser.parse_args()
    args.reused = set()
    if args.max_tokens_per_turn is None:
        from training.rollout.config import AsyncRLConfig

        args.max_tokens_per_turn = AsyncRLConfig.max_tokens_per_turn
    if args.heldout < 2 or args.attempts < 2:
        parser.error("paired intervals of pass@1 and pass@k need --heldout >= 2 and --attempts >= 2")
    if args.combine and not args.baseline:
        parser.error("--combine needs --baseline (the start's evaluation with the same settings)")
    if not Path(args.init_checkpoint).is_dir():
        parser.error(f"--init-checkpoint {args.init_checkpoint}: no such checkpoint directory")
    return args


def print_report(report: dict) -> None:
    for result in report["results"]:
        final = result["final"]
        print(f"{result['recipe']:<11} seed {result['seed']}: {result['minutes']:.1f} min, {result['steps']} steps, "
              f"held-out pass@1 {final['pass_at_1']:.3f}, pass@k {final['pass_at_k']:.3f}; curve {result['curve']}")
    for row in report.get("comparisons", []):
        for d in row["differences"]:
            mcnemar = f", McNemar p {d['mcnemar_p']:.3f}" if d["mcnemar_p"] is not None else ""
            print(f"{row['b']} - {row['a']} {d['metric']}: {d['a']:.3f} -> {d['b']:.3f} = {100 * d['difference']:+.1f} "
                  f"points, paired bootstrap 95% [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}] over {d['tasks']} "
                  f"tasks{mcnemar}")
    if report.get("seed_spread"):
        spread = report["seed_spread"]
        print(f"{spread['recipe']} over seeds {spread['seeds']}: pass@1 {spread['pass_at_1']}, mean "
              f"{spread['mean_pass_at_1']:.3f}, sd {spread['sd_pass_at_1']:.3f}, worst {spread['worst_pass_at_1']:.3f}; "
              f"mean pass@k {spread['mean_pass_at_k']:.3f}")


def main() -> None:
    args = parse_args()
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started, load_at_start = time.monotonic(), os.getloadavg()
    start = start_evaluation(args)
    start_curve = None
    if args.curve_heldout and not args.combine:
        start_curve = evaluate(args.init_checkpoint, args, tasks=args.curve_heldout, attempts=1)["pass_at_1"]
    (run_dir / "start_evaluation.json").write_text(json.dumps(asdict(start), indent=2, default=str))
    if args.combine:
        finished = [(result_load(Path(path), args), None) for path in args.combine]
    else:
        jobs = [("rl", seed) for seed in args.seeds] if args.seeds else [(r, args.seed) for r in args.recipes]
        finished = [run_and_evaluate(recipe, seed, args, start_curve) for recipe, seed in jobs]
    results = [result for result, _ in finished]
    evaluations = [start] + [result.final for result in results]
    for evaluation, result in zip(evaluations[1:], results, strict=True):
        evaluation.name = f"{result.recipe}-seed{result.seed}"
    report = {
        "settings": {key: value for key, value in vars(args).items() if key != "reused"},
        "load_average_at_start_and_end": [load_at_start, os.getloadavg()],
        "start": asdict(start) | {"per_task": None},
        "results": [asdict(result) | {"final": asdict(result.final) | {"per_task": None}} for result in results],
        "comparisons": comparisons(evaluations, args),
        "seed_spread": asdict(seed_spread("rl", results)) if args.seeds else None,
        "total_minutes": round((time.monotonic() - started) / 60, 1),
    }
    name = "seeds" if args.seeds else "combined" if args.combine else "recipes"
    plot(results, run_dir / f"{name}_heldout_pass_at_1.svg", args)
    if args.record_owner and not args.combine:
        report["experiments"] = record_experiments(finished, args)
    (run_dir / f"{name}_report.json").write_text(json.dumps(report, indent=2, default=str))
    print_report(report)
    print(f"report: {run_dir / f'{name}_report.json'}; plot: {run_dir / f'{name}_heldout_pass_at_1.svg'}")


if __name__ == "__main__":
    main()
