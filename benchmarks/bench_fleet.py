"""Sandbox fleet latencies on the Docker backend: cold create, warm claim, fork, exec, concurrency.

Baselines measured in the same run:
* cold create vs a bare ``docker run -d`` of the same image through the SDK (no overlay, no limits);
* warm claim vs cold create;
* fork of N vs N sequential cold creates;
* exec through the host actor (Ray) vs direct exec on the backend;
* N concurrent create+exec+destroy cycles vs the same cycles one after another.

Run as root with the sandbox image built:  .venv/bin/python benchmarks/bench_fleet.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from sandboxes.base import RepoSource, SandboxLimits
from sandboxes.tools import ToolCall, execute_tool_calls

LIMITS = SandboxLimits(command_timeout_s=30, lifetime_s=600, memory_mb=256, max_processes=64, disk_mb=64)


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return statistics.median(ordered), p95


def report(name: str, samples: list[float], baseline: list[float] | None = None, baseline_name: str = "") -> None:
    p50, p95 = percentiles(samples)
    line = f"{name:<34} p50 {p50 * 1000:9.2f} ms   p95 {p95 * 1000:9.2f} ms   (n={len(samples)})"
    if baseline:
        b50, _ = percentiles(baseline)
        line += f"   ratio vs {baseline_name}: {p50 / b50:.3g}x"
    print(line, flush=True)


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument("--fork", type=int, default=8, help="sandboxes per fork")
    parser.add_argument("--concurrency", type=int, default=8, help="parallel create+exec+destroy cycles")
    parser.add_argument("--no-ray", action="store_true", help="skip the host-actor round-trip figures")
    args = parser.parse_args()
    reps = 5 if args.quick else 15

    from sandboxes.base import BackendUnavailable
    from sandboxes.docker_backend import DockerBackend, DockerBackendConfig

    root = Path(tempfile.mkdtemp(prefix="bench-fleet-", dir="/tmp"))
    try:
        backend = DockerBackend(DockerBackendConfig(root=root, cpus=0.5))
    except BackendUnavailable as exc:
        # `make bench` runs every script; a machine without Docker or root has no figures to give.
        print(f"skipped: {exc}")
        return 0
    repo = root / "repo"
    repo.mkdir()
    for index in range(50):
        (repo / f"module_{index}.py").write_text(f"def f{index}(x):\n    return x + {index}\n" * 20)
    snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
    print(f"docker backend, image {backend.image}, {os.cpu_count()} CPUs, {reps} repetitions", flush=True)

    # Warm-up: first container start pays image/layer setup once.
    backend.sandbox_create(snapshot=snapshot, limits=LIMITS).destroy()

    cold = _bench_starts(backend, snapshot, reps)
    _bench_fork(backend, snapshot, reps=reps, count=args.fork, cold=cold)
    direct_exec = _bench_exec(backend, snapshot, reps)
    _bench_concurrency(backend, snapshot, args.concurrency)

    if not args.no_ray:
        _bench_ray(snapshot_dir=repo, reps=reps * 2, direct_exec=direct_exec)
    backend.close()
    backend.reap_orphans()
    return 0


def _bench_starts(backend, snapshot, reps: int) -> list[float]:
    """Bare docker run, cold create and warm claim; returns the cold creates."""
    client = backend._client
    bare: list[float] = []
    for _ in range(reps):
        started = time.perf_counter()
        container = client.containers.run(backend.image, ["sleep", "60"], detach=True, network_mode="none")
        bare.append(time.perf_counter() - started)
        container.remove(force=True)

    cold: list[float] = []
    for _ in range(reps):
        started = time.perf_counter()
        sandbox = backend.sandbox_create(snapshot=snapshot, limits=LIMITS)
        cold.append(time.perf_counter() - started)
        sandbox.destroy()
    report("bare docker run (baseline)", bare)
    report("cold create (hardened + overlay)", cold, bare, "bare docker run")

    warm: list[float] = []
    claimed = []
    backend.prewarm(snapshot=snapshot, limits=LIMITS, count=reps, wait=True)
    for _ in range(reps):
        started = time.perf_counter()
        claimed.append(backend.sandbox_create(snapshot=snapshot, limits=LIMITS))
        warm.append(time.perf_counter() - started)
    backend.close()  # stop refilling, so the pool does not start containers during later figures
    for sandbox in claimed:
        sandbox.destroy()
    report("warm claim", warm, cold, "cold create")
    return cold


def _bench_fork(backend, snapshot, *, reps: int, count: int, cold: list[float]) -> None:
    """One fork of `count` sandboxes against as many sequential creates."""
    fork_reps = max(2, reps // 5)
    forks: list[float] = []
    for _ in range(fork_reps):
        started = time.perf_counter()
        sandboxes = backend.sandbox_fork(snapshot=snapshot, count=count, limits=LIMITS)
        forks.append(time.perf_counter() - started)
        for sandbox in sandboxes:
            sandbox.destroy()
    sequential = [p * count for p in cold]
    report(f"fork of {count}", forks, sequential, f"{count} sequential creates")
    report(f"fork of {count}, per sandbox", [f / count for f in forks])


def _bench_exec(backend, snapshot, reps: int) -> list[float]:
    """Direct exec and host-side file reads; returns the exec times."""
    sandbox = backend.sandbox_create(snapshot=snapshot, limits=LIMITS)
    direct_exec = [timed(lambda: sandbox.exec("echo hi")) for _ in range(reps * 2)]
    report("exec 'echo hi' direct", direct_exec)
    file_ops = [timed(lambda: sandbox.read_bytes("module_7.py")) for _ in range(reps * 2)]
    report("read_bytes (host side)", file_ops, direct_exec, "exec")
    sandbox.destroy()
    return direct_exec


def _bench_concurrency(backend, snapshot, concurrency: int) -> None:
    """create+exec+destroy cycles one at a time and `concurrency` at once."""
    def cycle() -> float:
        return timed(lambda: _cycle(backend, snapshot))

    serial_start = time.perf_counter()
    serial = [cycle() for _ in range(concurrency)]
    serial_wall = time.perf_counter() - serial_start
    parallel_start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        parallel = list(pool.map(lambda _: cycle(), range(concurrency)))
    parallel_wall = time.perf_counter() - parallel_start
    report("create+exec+destroy, 1 at a time", serial)
    report(f"create+exec+destroy, {concurrency} at once", parallel)
    print(f"{'throughput':<34} {concurrency / parallel_wall:8.2f} sandboxes/s concurrent vs "
          f"{concurrency / serial_wall:.2f} serial   ratio: {serial_wall / parallel_wall:.2f}x", flush=True)


def _cycle(backend, snapshot) -> None:
    sandbox = backend.sandbox_create(snapshot=snapshot, limits=LIMITS)
    try:
        result = sandbox.exec("python3 -c 'print(1)'")
        if result.exit_code != 0:
            raise RuntimeError(f"benchmark command failed: {result.stderr}")
    finally:
        sandbox.destroy()


def _bench_ray(*, snapshot_dir: Path, reps: int, direct_exec: list[float]) -> None:
    import ray

    from sandboxes.fleet.client import Fleet, FleetConfig

    ray.init(address="local", num_cpus=1, resources={"sandbox_slots": 4}, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        fleet = Fleet.start(FleetConfig(backend="docker", heartbeat_sink=None))
        snapshot = fleet.snapshot_create(source=RepoSource(kind="path", location=str(snapshot_dir)))
        creates = []
        sandboxes = []
        for _ in range(4):
            started = time.perf_counter()
            sandboxes.append(fleet.sandbox_create(snapshot=snapshot, limits=LIMITS))
            creates.append(time.perf_counter() - started)
        report("fleet create (via host actor)", creates)
        sandbox = sandboxes[0]
        via_actor = [timed(lambda: sandbox.exec("echo hi")) for _ in range(reps)]
        report("exec 'echo hi' via host actor", via_actor, direct_exec, "direct exec")
        # One model turn of 10 parallel read_file calls, as the agent loop sends it (one batch, one
        # host-actor call), against the same 10 calls sent one after another.
        turn = [ToolCall(str(i), "read_file", {"path": f"module_{i}.py"}) for i in range(10)]
        one_by_one = [timed(lambda: [execute_tool_calls(sandbox=sandbox, calls=[call]) for call in turn])
                      for _ in range(reps)]
        batched = [timed(lambda: execute_tool_calls(sandbox=sandbox, calls=turn)) for _ in range(reps)]
        assert all(result.ok for result in execute_tool_calls(sandbox=sandbox, calls=turn))
        report("10 read_file, one turn, via host actor", batched, one_by_one, "one by one")
        # A fifth request queues until a slot frees: the wait is the admission queue at work.
        with ThreadPoolExecutor(max_workers=1) as pool:
            started = time.perf_counter()
            queued = pool.submit(fleet.sandbox_create, snapshot=snapshot, limits=LIMITS, purpose="product")
            time.sleep(0.5)
            sandboxes.pop().destroy()
            queued.result().destroy()
            print(f"{'queued request admitted after':<34} {(time.perf_counter() - started) * 1000:8.1f} ms "
                  "(slot freed at 500 ms)", flush=True)
        fleet.shutdown()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
