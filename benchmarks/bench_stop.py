"""How long `make run` takes to stop: first signal -> last process of the run gone (issue 52).

Starts the real supervisor (scripts/run.py: embedded Redis, Ray head, Celery worker, sandbox fleet,
uvicorn) from a temporary copy of this checkout, once per case, waits for /healthz, stops it and
walks /proc until no process of the run is left (its process groups, or its state directory in a
process's environment, working directory or command line). Cases: one SIGINT to the supervisor;
SIGTERM to its process group; SIGINT, SIGTERM, SIGINT 0.1 s apart; SIGKILL of the supervisor alone
(its children then get SIGTERM from the kernel; what is left would be removed by the next start).
Also prints the supervisor's own per-child stop times. Goal: every case under 20 s.

Run:  .venv/bin/python benchmarks/bench_stop.py [--cases sigint,sigterm-group,three-signals,kill-9]
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.platform.supervisor_harness import kill_leftovers, make_checkout_copy, start_run, stop_and_time

CASES = ("sigint", "sigterm-group", "three-signals", "kill-9")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    checkout = make_checkout_copy()
    rows = []
    try:
        for how in args.cases.split(","):
            started = time.monotonic()
            run = start_run(checkout)
            up_s = time.monotonic() - started
            seconds, left = stop_and_time(run, how, limit_s=60.0)
            run.process.wait(timeout=10)
            per_child = ", ".join(f"{name} +{at}s" for name, at in
                                  re.findall(r"\] stopped (.+?) at \+([\d.]+)s", run.log()))
            rows.append((how, seconds, len(left), up_s))
            print(f"{how:14s} stop {seconds:5.1f}s  left {len(left)}  (start took {up_s:.0f}s)  {per_child}",
                  flush=True)
            for line in left:
                print(f"    left: {line}")
            kill_leftovers(run)
    finally:
        shutil.rmtree(checkout.parent, ignore_errors=True)
    print("\ncase | first signal -> last process gone | processes left after 60 s")
    for how, seconds, left, _ in rows:
        print(f"{how} | {seconds:.1f} s | {left}")
    return 0 if all(seconds <= 20 and not left for _, seconds, left, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
