"""Host memory of the host-side tools on a hostile file, and snapshot creation time (issue 42).

A sandbox (local backend) gets a 30 MB Python file of 2-byte lines (``x\\n`` * 15M: every line is an
undefined name, the worst case for lint output too). Each operation then runs in its own fresh
process: ``read_file``, ``read_lints`` on the file, and the sandbox's ``diff()``. The figure is the
process's peak RSS growth during the operation (``/proc/self/clear_refs`` resets VmHWM, then the
peak minus the RSS before); child processes (ruff) are reported separately from RUSAGE_CHILDREN.

Snapshot creation time: median of N ``snapshot_create`` calls from a .tar.gz archive and from a
local git repository of this repository's ``sandboxes/`` and ``webapp/`` trees.

``--code-root DIR`` imports the sandboxes package from DIR (e.g. an export of the old commit:
``git archive b10ec9e | tar -x -C /tmp/base``); ``--baseline FILE`` prints ratios against a JSON
written by an earlier run with ``--out FILE``. Needs root (the local backend's namespaces).

``--compare-extract OLD_ROOT`` times archive extraction alone, old and new interleaved in one process
(old in-process; new in-process and in its unprivileged forked child), which the shared machine's
load affects equally.

Run: .venv/bin/python benchmarks/bench_host_memory.py [--code-root DIR] [--out new.json] [--baseline old.json]
     .venv/bin/python benchmarks/bench_host_memory.py --compare-extract /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINES = 15_000_000


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _operation(op: str, root: str) -> dict:
    """Runs in a child: build a sandbox holding the big file, then measure one operation."""
    from sandboxes.base import RepoSource, SandboxLimits
    from sandboxes.local_backend import LocalBackend, LocalBackendConfig
    from sandboxes.tools import ToolCall, execute_tool_calls

    backend = LocalBackend(LocalBackendConfig(root=Path(root), warm_pool_size=0))
    repo = Path(root) / "repo"
    repo.mkdir(exist_ok=True)
    (repo / "small.py").write_text("A = 1\n")
    snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
    limits = SandboxLimits(disk_mb=256, memory_mb=512, command_timeout_s=120, lifetime_s=900)
    box = backend.sandbox_create(snapshot=snapshot, limits=limits)
    try:
        box.exec(f"python3 -c \"open('big.py', 'w').write('x\\\\n' * {LINES})\"")
        Path("/proc/self/clear_refs").write_text("5")
        before = _status("VmRSS")
        started = time.perf_counter()
        error = ""
        try:
            if op == "diff":
                output = box.diff()
            else:
                arguments = {"path": "big.py"} if op == "read_file" else {"paths": ["big.py"]}
                result = execute_tool_calls(sandbox=box, calls=[ToolCall(id="c", name=op, arguments=arguments)])[0]
                output = result.output
        except Exception as exc:  # noqa: BLE001 - the old code crashes on this input; its peak still counts
            output, error = "", f"{type(exc).__name__}: {str(exc)[:200]}"
        elapsed = time.perf_counter() - started
        peak = _status("VmHWM")
        children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        return {"op": op, "growth_mib": round((peak - before) / 2**20, 1), "seconds": round(elapsed, 2),
                "children_peak_mib": round(children / 2**20, 1), "output_bytes": len(output.encode()), **({"error": error} if error else {})}
    finally:
        box.destroy()
        backend.close()


def _snapshot_times(root: str, repeats: int) -> dict:
    from sandboxes.base import RepoSource
    from sandboxes.local_backend import LocalBackend, LocalBackendConfig

    backend = LocalBackend(LocalBackendConfig(root=Path(root), warm_pool_size=0))
    work = Path(root) / "src"
    for tree in ("sandboxes", "webapp"):
        shutil.copytree(REPO / tree, work / tree, ignore=shutil.ignore_patterns("__pycache__"))
    archive = Path(root) / "src.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(work, arcname=".")
    git = ["git", "-c", "user.name=b", "-c", "user.email=b@example.com", "-C", str(work)]
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    figures = {}
    for kind, location in (("archive", str(archive)), ("git", str(work))):
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            snapshot = backend.snapshot_create(source=RepoSource(kind=kind, location=location))
            times.append(time.perf_counter() - started)
            backend.snapshot_delete(snapshot=snapshot)
        figures[f"snapshot_{kind}_s"] = round(statistics.median(times), 3)
    backend.close()
    return figures


def _compare_extract(old_root: str, repeats: int) -> dict:
    """Archive extraction alone, old and new interleaved in one process (the machine's load is shared)."""
    import importlib.util

    sys.path.insert(0, str(REPO))
    from sandboxes.archives import extract_archive as new

    spec = importlib.util.spec_from_file_location("old_archives", Path(old_root) / "sandboxes" / "archives.py")
    old_module = importlib.util.module_from_spec(spec)
    sys.modules["old_archives"] = old_module
    spec.loader.exec_module(old_module)
    work = Path(tempfile.mkdtemp(prefix="bench-extract-", dir="/tmp"))
    os.chmod(work, 0o755)
    source = work / "src"
    for tree in ("sandboxes", "webapp"):
        shutil.copytree(REPO / tree, source / tree, ignore=shutil.ignore_patterns("__pycache__"))
    archive = work / "src.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source, arcname=".")
    runs: dict[str, list[float]] = {"old": [], "new_in_process": [], "new_unprivileged_child": []}
    for _ in range(repeats):
        for key, times in runs.items():
            destination = work / key
            shutil.rmtree(destination, ignore_errors=True)
            destination.mkdir()
            started = time.perf_counter()
            if key == "old":
                old_module.extract_archive(archive, destination)
            else:
                new(archive, destination, run_as=(101000, 101000) if key.endswith("child") else None)
            times.append(time.perf_counter() - started)
    shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(runs["old"])
    return {key: {"median_s": round(statistics.median(times), 4), "ratio": round(statistics.median(times) / base, 3)}
            for key, times in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code-root", default=str(REPO))
    parser.add_argument("--out")
    parser.add_argument("--baseline")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ops", default="read_file,read_lints,diff,snapshots", help="comma-separated subset")
    parser.add_argument("--compare-extract", metavar="OLD_ROOT",
                        help="only time archive extraction against the code under OLD_ROOT, interleaved")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compare_extract:
        print(json.dumps(_compare_extract(args.compare_extract, args.repeats * 2)))
        return
    sys.path.insert(0, args.code_root)
    if args.child:
        result = _snapshot_times(args.root, args.repeats) if args.child == "snapshots" else _operation(args.child, args.root)
        import sandboxes

        print(json.dumps({**result, "code": str(Path(sandboxes.__file__).parent)}))
        return
    figures: dict = {}
    for child in args.ops.split(","):
        root = tempfile.mkdtemp(prefix="bench-host-mem-", dir="/tmp")
        os.chmod(root, 0o711)
        try:
            done = subprocess.run([sys.executable, __file__, "--child", child, "--root", root, "--code-root",
                                   args.code_root, "--repeats", str(args.repeats)],
                                  capture_output=True, text=True, timeout=1800, check=False)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if done.returncode != 0:
            figures[child] = {"error": done.stderr.strip()[-600:]}
        else:
            figures[child] = json.loads(done.stdout.strip().splitlines()[-1])
        print(child, json.dumps(figures[child]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    if args.baseline:
        old = json.loads(Path(args.baseline).read_text())
        for op in ("read_file", "read_lints", "diff"):
            if "growth_mib" in figures.get(op, {}) and "growth_mib" in old.get(op, {}):
                ratio = old[op]["growth_mib"] / max(figures[op]["growth_mib"], 0.1)
                print(f"{op}: peak growth {figures[op]['growth_mib']} MiB (was {old[op]['growth_mib']} MiB, "
                      f"{ratio:.1f}x less); {figures[op]['seconds']} s (was {old[op]['seconds']} s)")
        for key, value in figures.get("snapshots", {}).items():
            if key in old.get("snapshots", {}):
                print(f"{key}: {value} s (was {old['snapshots'][key]} s, ratio {value / old['snapshots'][key]:.2f})")


if __name__ == "__main__":
    main()
