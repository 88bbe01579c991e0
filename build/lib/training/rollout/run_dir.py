"""The run directory: the files an RL driver writes and the web app reads (its only contract with it).

A driver run owns one directory (AsyncRLConfig.run_dir):

- ``checkpoints/step-NNNNNNNN/``: training checkpoints (training.train.state); the newest complete one is the
  run's policy version (``checkpointed_version``) and where a restarted driver resumes.
- ``metrics.jsonl``: one line per policy update (``"step"`` = the new version).
- ``rollouts.jsonl``: one line per rollout trained on or abandoned, with its update's ``"step"``.
- ``traces/<rollout id>.json``: the full agent trace of each of those rollouts (``trace_path``).
- ``driver_status.json``: the driver's state (``running``, ``stopped`` or ``finished``), pid and version.

Log lines are written before the checkpoint of their step; a resumed run truncates lines past its checkpoint
(``truncate_jsonl``), so readers that stop at ``checkpointed_version`` never see a step twice. Importing this
module imports neither torch nor Ray: the web process reads runs through it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
ROLLOUTS_FILE = "rollouts.jsonl"
STATUS_FILE = "driver_status.json"
TRACES_DIR = "traces"


def trace_path(run_dir: str | Path, rollout_id: str) -> Path:
    """Where the full agent trace (events, messages, diff) of a trained rollout is stored."""
    return Path(run_dir) / TRACES_DIR / (rollout_id.replace("/", "__").replace("~", "_") + ".json")


def checkpointed_version(run_dir: str | Path) -> int:
    """Policy version of the newest complete checkpoint of the run (0 when there is none)."""
    from training.train.state import latest_checkpoint

    path = latest_checkpoint(run_dir)
    return int(path.name.rsplit("-", 1)[-1]) if path is not None else 0


def run_finished(run_dir: str | Path) -> bool:
    """True when the run's driver last reported it finished: all its steps done, or its time budget spent."""
    try:
        return json.loads((Path(run_dir) / STATUS_FILE).read_text()).get("state") == "finished"
    except (OSError, ValueError):
        return False


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record, default=str) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def truncate_jsonl(path: Path, *, max_step: int) -> None:
    """Drop log lines of steps after the checkpoint we resume from (they will be redone)."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= max_step
    ]
    temporary = path.with_suffix(".tmp")
    temporary.write_text("".join(line + "\n" for line in kept))
    os.replace(temporary, path)


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_json(path: Path, data: dict) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, default=str))
    os.replace(temporary, path)


def read_status(run_dir: str | Path) -> dict:
    path = Path(run_dir) / STATUS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def write_status(run_dir: Path, status: dict) -> None:
    temporary = run_dir / (STATUS_FILE + ".tmp")
    temporary.write_text(json.dumps({**status, "updated_at": time.time()}))
    os.replace(temporary, run_dir / STATUS_FILE)
