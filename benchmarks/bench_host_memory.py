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

``--compare-extract OLD_ROOT [--compare-previous PREVIOUS_ROOT]`` times archive extraction alone, every
variant interleaved in one process (old in process; the previous interpreter-per-archive child; new in
process; new through the pre-started unprivileged fork server, warm and cold), which the shared
machine's load affects equally; it prints each median and its ratio to the old one.

``--backend docker`` measures the host-memory operations on a Docker sandbox (ops: read_file,
read_lints, diff, grep, run_terminal, edit_file).

Run: .venv/bin/python benchmarks/bench_host_memory.py [--code-root DIR] [--out new.json] [--baseline old.json]
     .venv/bin/python benchmarks/bench_host_memory.py --compare-extract /tmp/base --compare-previous /tmp/prev
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


TOOL_ARGUMENTS = {
    "read_file": {"path": "big.py"},
    "read_lints": {"paths": ["big.py"]},
    "grep": {"pattern": "x", "max_results": 500},
    "run_terminal": {"command": "cat big.py"},
    "edit_file": {"path": "big.py", "old_str": "x\nx\nx\n", "new_str": "y\n"},
}
"""The tool calls measured (besides the sandbox's own ``diff()``) and their arguments."""


def _backend(name: str, root: str):
    if name == "docker":
        from sandboxes.docker_backend import DockerBackend, DockerBackendConfig

        return DockerBackend(DockerBackendConfig(root=Path(root)))
    from sandboxes.local_backend import LocalBackend, LocalBackendConfig

    return LocalBackend(LocalBackendConfig(root=Path(root), warm_pool_size=0))


def _measure(box, op: str) -> dict:
    import ctypes
    import gc

    from sandboxes.tools import ToolCall, execute_tool_calls

    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # give back what an earlier op freed, so reusing it counts as growth
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS, so the peak below is this call's
    before = _status("VmRSS")
    started = time.perf_counter()
    error = ""
    try:
        if op == "diff":
            output = box.diff()
        else:
            output = execute_tool_calls(sandbox=box, calls=[ToolCall(id="c", name=op, arguments=TOOL_ARGUMENTS[op])])[0].output
    except Exception as exc:  # noqa: BLE001 - the old code crashes on this input; its peak still counts
        output, error = "", f"{type(exc).__name__}: {str(exc)[:200]}"
    elapsed = time.perf_counter() - started
    peak = _status("VmHWM")
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"op": op, "growth_mib": round((peak - before) / 2**20, 1), "seconds": round(elapsed, 2),
            "children_peak_mib": round(children / 2**20, 1), "output_bytes": len(output.encode()),
            "output_head": output[:160], **({"error": error} if error else {})}


def _operations(ops: list[str], root: str, backend_name: str = "local") -> list[dict]:
    """Runs in a child: build a sandbox holding the big file, then measure each operation in turn."""
    from sandboxes.base import RepoSource, SandboxLimits

    backend = _backend(backend_name, root)
    repo = Path(root) / "repo"
    repo.mkdir(exist_ok=True)
    (repo / "small.py").write_text("A = 1\n")
    snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
    limits = SandboxLimits(disk_mb=256, memory_mb=512, command_timeout_s=120, lifetime_s=900)
    box = backend.sandbox_create(snapshot=snapshot, limits=limits)
    try:
        made = box.exec(f"python3 -c \"open('big.py', 'w').write('x\\\\n' * {LINES})\"")
        assert made.exit_code == 0, made
        return [{**_measure(box, op), "backend": backend_name} for op in ops]
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


def _load_archives(root: str, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(root) / "sandboxes" / "archives.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _stop_servers() -> None:
    from sandboxes import extract_server

    with extract_server._servers_lock:
        servers = list(extract_server._servers.values())
        extract_server._servers.clear()
    for server in servers:
        server.close()


def _compare_extract(old_root: str, repeats: int, previous_root: str | None = None) -> dict:
    """Archive extraction alone, every variant interleaved in one process (the machine's load is shared).

    old_in_process: the code before issue 42 (OLD_ROOT); previous_child: issue 42's first version, a fresh
    unprivileged interpreter per archive (PREVIOUS_ROOT); new_in_process: today's extractor, no privilege
    drop; new_server: what a root worker does now, the pre-started unprivileged fork server;
    new_server_cold: the same with the server started by this very call (a worker's first archive when
    the backend did not pre-start it)."""
    sys.path.insert(0, str(REPO))
    from sandboxes.archives import extract_archive as new

    old_module = _load_archives(old_root, "old_archives")
    previous = _load_archives(previous_root, "previous_archives") if previous_root else None
    work = Path(tempfile.mkdtemp(prefix="bench-extract-", dir="/tmp"))
    os.chmod(work, 0o755)
    source = work / "src"
    for tree in ("sandboxes", "webapp"):
        shutil.copytree(REPO / tree, source / tree, ignore=shutil.ignore_patterns("__pycache__"))
    archive = work / "src.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source, arcname=".")
    run_as = (101000, 101000)
    members = _members(archive)
    variants = {
        "old_in_process": lambda d: old_module.extract_archive(archive, d),
        **({"previous_child": lambda d: previous.extract_archive(archive, d, run_as=run_as)} if previous else {}),
        "new_in_process": lambda d: new(archive, d),
        "new_server": lambda d: new(archive, d, run_as=run_as),
        "new_server_cold": lambda d: (_stop_servers(), new(archive, d, run_as=run_as)),
    }
    new(archive, work / "warm-up", run_as=run_as)  # the backend pre-starts the server when it is created
    runs: dict[str, list[float]] = {key: [] for key in variants}
    for _ in range(repeats):
        for key, extract in variants.items():
            destination = work / key
            shutil.rmtree(destination, ignore_errors=True)
            destination.mkdir()
            if key == "new_server":
                from sandboxes import extract_server

                extract_server.server_for(run_as)  # started by new_server_cold's previous round, maybe
            started = time.perf_counter()
            extract(destination)
            runs[key].append(time.perf_counter() - started)
    _stop_servers()
    shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(runs["old_in_process"])
    return {"load_average": os.getloadavg(), "members": members, "rounds": repeats,
            **{key: {"median_s": round(statistics.median(times), 4), "ratio": round(statistics.median(times) / base, 3)}
               for key, times in runs.items()}}


def _members(archive: Path) -> int:
    with tarfile.open(archive) as tar:
        return len(tar.getmembers())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code-root", default=str(REPO))
    parser.add_argument("--out")
    parser.add_argument("--baseline")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ops", default="read_file,read_lints,diff,grep,run_terminal,edit_file,snapshots",
                        help="comma-separated subset")
    parser.add_argument("--backend", choices=("local", "docker"), default="local",
                        help="backend of the sandbox holding the big file (host-memory ops)")
    parser.add_argument("--compare-extract", metavar="OLD_ROOT",
                        help="only time archive extraction against the code under OLD_ROOT, interleaved")
    parser.add_argument("--compare-previous", metavar="PREVIOUS_ROOT",
                        help="with --compare-extract: also time the code under PREVIOUS_ROOT as root would run it")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compare_extract:
        figures = _compare_extract(args.compare_extract, args.repeats * 2, args.compare_previous)
        print(json.dumps(figures))
        for key in figures:
            if isinstance(figures[key], dict):
                print(f"{key}: median {figures[key]['median_s']} s, ratio to old {figures[key]['ratio']}")
        return
    sys.path.insert(0, args.code_root)
    if args.child:
        import sandboxes

        code = str(Path(sandboxes.__file__).parent)
        if args.child == "snapshots":
            print(json.dumps({**_snapshot_times(args.root, args.repeats), "code": code}))
        else:  # one op, or several (comma-separated) measured in turn on one sandbox
            results = _operations(args.child.split(","), args.root, args.backend)
            print(json.dumps({**results[0], "code": code} if len(results) == 1 else {"ops": results, "code": code}))
        return
    figures: dict = {}
    for child in args.ops.split(","):
        root = tempfile.mkdtemp(prefix="bench-host-mem-", dir="/tmp")
        os.chmod(root, 0o711)
        try:
            done = subprocess.run([sys.executable, __file__, "--child", child, "--root", root, "--code-root",
                                   args.code_root, "--repeats", str(args.repeats), "--backend", args.backend],
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
        for op in ("read_file", "read_lints", "diff", "grep", "run_terminal", "edit_file"):
            if "growth_mib" in figures.get(op, {}) and "growth_mib" in old.get(op, {}):
                ratio = old[op]["growth_mib"] / max(figures[op]["growth_mib"], 0.1)
                print(f"{op}: peak growth {figures[op]['growth_mib']} MiB (was {old[op]['growth_mib']} MiB, "
                      f"{ratio:.1f}x less); {figures[op]['seconds']} s (was {old[op]['seconds']} s)")
        for key, value in figures.get("snapshots", {}).items():
            if key in old.get("snapshots", {}):
                print(f"{key}: {value} s (was {old['snapshots'][key]} s, ratio {value / old['snapshots'][key]:.2f})")


if __name__ == "__main__":
    main()
