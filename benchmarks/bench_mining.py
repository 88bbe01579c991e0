"""Task mining on real open-source Python projects: setup, baseline, candidates, yield, expert solve rate.

For each project (a PyPI sdist that ships its tests, pure Python) the sdist is downloaded once into
var/bench_mining/ (``pip download --no-binary :all: --no-deps``), unpacked, and run through the same path
as the web app: training.tasks.environment.environment_prepare (detect, set up with the network on for the
setup phase: pytest and the project installed into .flowstate/site; baseline run without network), then
training.tasks.repo_mining.mine_repository_tasks (mutations; sdists carry no git history).

Printed per project: setup time, baseline suite time and tests, candidates tried, validated tasks, yield,
validated tasks per CPU-minute, and the solve rates of the scripted expert and of the demo model (models/demo,
through training.bench.runner.run_benchmark like a leaderboard run) on the held-out tasks. CPU-minutes are
the mining run's wall-clock minutes times its workers (one candidate's test run keeps about one core busy;
the machine is shared, so it is an upper bound on the CPU the run itself used), reported beside the load
average. Target: >= 30 validated tasks per project within 30 CPU-minutes.

Run:  .venv/bin/python benchmarks/bench_mining.py [--projects inflection==0.5.1 toolz==0.12.1]
      [--max-candidates 200] [--max-tasks 60] [--budget-minutes 30] [--workers 1] [--selection calls]
      [--demo-tasks N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEFAULT_PROJECTS = ("inflection==0.5.1", "toolz==0.12.1", "more-itertools==10.5.0")


def fetch_sdist(spec: str, root: Path) -> Path:
    """The unpacked sdist of ``spec`` under ``root`` (downloaded once)."""
    name = spec.split("==")[0]
    target = root / spec.replace("==", "-")
    if target.is_dir():
        return target
    downloads = root / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
                    "--dest", str(downloads), spec], check=True)
    archive = next(p for p in sorted(downloads.iterdir())
                   if p.name.lower().replace("_", "-").startswith(name.lower().replace("_", "-")))
    with tarfile.open(archive) as tar:
        tar.extractall(root / "unpacked", filter="data")
    unpacked = next(p for p in (root / "unpacked").iterdir()
                    if p.name.lower().replace("_", "-").startswith(name.lower().replace("_", "-")))
    unpacked.rename(target)
    return target


def bench_project(spec: str, args) -> dict:
    from sandboxes import get_backend
    from sandboxes.base import RepoSource
    from training.tasks.autoinstall import InstallFailure, SetupBudget
    from training.tasks.environment import environment_prepare
    from training.tasks.repo_mining import MiningConfig, mine_repository_tasks

    path = fetch_sdist(spec, ROOT / "var" / "bench_mining")
    backend = get_backend("local")
    started = time.monotonic()
    prepared = environment_prepare(backend=backend, source=RepoSource(kind="path", location=str(path)),
                                   budget=SetupBudget(network=True, setup_timeout_s=600, test_timeout_s=300))
    setup_s = time.monotonic() - started
    if isinstance(prepared, InstallFailure):
        return {"project": spec, "failed": f"{prepared.stage}: {prepared.reason}", "log": prepared.log[-3000:]}
    config = MiningConfig(max_candidates=args.max_candidates, max_tasks=args.max_tasks, history_commits=0,
                          seed=0, time_budget_s=args.budget_minutes * 60, workers=args.workers, expert_check=False,
                          selection=args.selection)
    result = mine_repository_tasks(backend=backend, prepared=prepared, config=config, repo_label=spec.split("==")[0])
    cpu_minutes = result.wall_s * args.workers / 60
    from training.tasks.repo_mining import expert_solves

    heldout = [task for task in result.tasks if task.split == "heldout"]
    expert_started = time.monotonic()
    solved = sum(expert_solves(backend=backend, prepared=prepared, task=task) for task in heldout)
    expert_s = time.monotonic() - expert_started
    demo = None
    if args.demo_tasks and heldout:
        seeded = prepared_task_snapshots(backend=backend, prepared=prepared, tasks=heldout[: args.demo_tasks])
        demo = demo_model_rate(heldout[: args.demo_tasks])
        for snapshot in seeded:
            backend.snapshot_delete(snapshot=snapshot)
    backend.snapshot_delete(snapshot=prepared.snapshot)
    baseline = prepared.recipe.baseline
    return {
        "project": spec, "setup_s": round(setup_s - baseline["duration_s"], 1), "baseline_s": baseline["duration_s"],
        "baseline_tests": f"{len(baseline['passed'])} pass / {len(baseline['failed'])} fail / "
                          f"{len(baseline['errored'])} error",
        "recipe": list(prepared.recipe.setup_commands) + [prepared.recipe.test_command],
        "candidates_tried": result.tried, "validated": len(result.tasks),
        "yield": round(len(result.tasks) / result.tried, 3) if result.tried else 0.0,
        "cpu_minutes": round(cpu_minutes, 2),
        "validated_per_cpu_minute": round(len(result.tasks) / cpu_minutes, 2) if cpu_minutes else None,
        "heldout_tasks": len(heldout), "expert_heldout_solve_rate": round(solved / len(heldout), 3) if heldout else None,
        "expert_s": round(expert_s, 1), "stopped": result.stopped,
        "demo_model_heldout_pass_at_1": demo, "selection": args.selection, "test_runs": dict(result.runs),
        "selection_note": result.selection_note,
        "rejected": dict(result.rejected.most_common()),
    }


def prepared_task_snapshots(*, backend, prepared, tasks) -> list:
    """One snapshot per task: the prepared environment's tree (setup done) with the task's buggy file, used as
    the task's snapshot (training.tasks.sandboxing.task_snapshot_put) so the benchmark does not repeat the
    networked setup per task. The local backend's snapshot tree is copied on the host."""
    import shutil
    import tempfile

    from sandboxes.base import RepoSource
    from training.tasks.sandboxing import task_snapshot_put

    snapshots = []
    for task in tasks:
        with tempfile.TemporaryDirectory(prefix="bench-mining-task-") as directory:
            tree = Path(directory) / "tree"
            shutil.copytree(prepared.snapshot.location, tree, symlinks=True)
            (tree / task.solution.path).write_text(task.files[task.solution.path])
            snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(tree)))
        task_snapshot_put(backend=backend, task=task, snapshot=snapshot)
        snapshots.append(snapshot)
    return snapshots


def demo_model_rate(tasks) -> dict:
    """pass@1 of the demo model (models/demo) on the given held-out tasks, through run_benchmark."""
    from training.bench.runner import BenchConfig, run_benchmark

    config = BenchConfig(suite="taskset-0-heldout", policy=f"checkpoint:{ROOT / 'models' / 'demo'}", attempts=1,
                         max_turns=8, temperature=0.0, concurrency=1, wall_time_s=300, sandbox_backend="local",
                         disable_tools=("semantic_search",))
    started = time.monotonic()
    summary = run_benchmark(config=config, tasks=list(tasks))
    return {"tasks": len(tasks), "pass_at_1": summary["pass_at_1"], "infra_failures": summary["infrastructure_failures"],
            "wall_s": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--projects", nargs="+", default=list(DEFAULT_PROJECTS))
    parser.add_argument("--max-candidates", type=int, default=300)
    parser.add_argument("--max-tasks", type=int, default=60)
    parser.add_argument("--budget-minutes", type=float, default=30.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--demo-tasks", type=int, default=1000,
                        help="Run the demo model (models/demo) on at most this many held-out tasks (0: skip).")
    parser.add_argument("--selection", default="calls", choices=("calls", "calls+full", "full"),
                        help="Tests a candidate runs (MiningConfig.selection).")
    args = parser.parse_args()
    for spec in args.projects:
        load_before = os.getloadavg()
        row = bench_project(spec, args)
        row["load_avg_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
        for key, value in row.items():
            print(f"{key:>28}: {value}")
        print(flush=True)


if __name__ == "__main__":
    main()
