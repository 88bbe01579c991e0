"""Exact-resume training checkpoints: model, optimizer, scheduler, RNG streams and data position.

A checkpoint is a directory `<run_dir>/checkpoints/step-00000042/` holding

    model.safetensors      \
    config.json             > a training.checkpoint directory: loadable by load_checkpoint / ChatModel
    tokenizer.json         /   (an imported model's: hf/ with its tokenizer files, template and HF config)
    optimizer.pt           optimizer.state_dict()  (tensors and numbers only: loads with weights_only)
    scheduler.pt           lr scheduler state_dict()
    rng.pt                 torch CPU (and CUDA) generator states
    trainer_state.json     step, data position, python/numpy RNG states, the run config, last metrics

It is written into a hidden `.partial-*` sibling, every file fsynced, then renamed into place; a
crash (even SIGKILL) mid-save leaves the previous checkpoint as the newest complete one, and the
partial directory is ignored and cleaned up by the next save.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_model

from training.checkpoint import WEIGHTS_FILE, save_checkpoint
from training.model.transformer import MoETransformer
from training.tokenizer import BPETokenizer

if TYPE_CHECKING:
    from training.hf.policy import HFTokenizer

CHECKPOINTS_DIR = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
TRAINER_STATE_FILE = "trainer_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be resumed from; the message names the missing piece."""


def capture_rng_state() -> dict[str, Any]:
    """Every random stream the training loop draws from (python, numpy legacy global, torch)."""
    kind, keys, position, has_gauss, cached_gauss = np.random.get_state()
    state = {
        "python": _jsonable(random.getstate()),
        "numpy": [kind, keys.tolist(), int(position), int(has_gauss), float(cached_gauss)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuplify(state["python"]))
    kind, keys, position, has_gauss, cached_gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached_gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class TrainCheckpoint:
    """What a resumed run needs, as loaded from disk."""

    path: Path
    """The step directory."""

    step: int
    """Optimizer steps completed when the checkpoint was written."""

    data_position: dict[str, Any]
    """The data source's state_dict(): where the next batch starts."""

    run_config: dict[str, Any]
    """The run's config as saved (to detect a resume with different settings)."""

    metrics: dict[str, Any]
    """Metrics of the last completed step."""


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step-{step:08d}"


def save_train_checkpoint(
    *,
    run_dir: str | Path,
    step: int,
    model: MoETransformer,
    tokenizer: BPETokenizer | HFTokenizer,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    data_position: dict[str, Any],
    run_config: dict[str, Any],
    metrics: dict[str, Any] | None = None,
    keep_last: int = 2,
) -> Path:
    """Write the checkpoint for `step` atomically and prune all but the newest `keep_last`."""
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1 so the checkpoint just written is kept.")
    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    partial = root / f".partial-step-{step:08d}-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    # The model half is an ordinary training.checkpoint directory, so any step can be served or
    # fine-tuned with load_checkpoint / ChatModel.load.
    save_checkpoint(partial, model, tokenizer, {"source": "training", "step": step})
    torch.save(optimizer.state_dict(), partial / "optimizer.pt")
    torch.save(scheduler.state_dict(), partial / "scheduler.pt")
    rng = capture_rng_state()
    torch.save({key: rng[key] for key in ("torch", "cuda") if key in rng}, partial / "rng.pt")
    trainer_state = {
        "step": step,
        "data_position": data_position,
        "rng": {"python": rng["python"], "numpy": rng["numpy"]},
        "run_config": run_config,
        "metrics": metrics or {},
    }
    (partial / TRAINER_STATE_FILE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
    for file in partial.rglob("*"):  # an imported model's tokenizer files sit in hf/
        if file.is_file():
            _fsync_file(file)
    final = checkpoint_dir(run_dir, step)
    if final.exists():
        # Re-saving a step (e.g. a resumed run that saves on exit): move the old one aside first,
        # since rename() onto a non-empty directory fails.
        aside = root / f".partial-replaced-{uuid.uuid4().hex[:8]}"
        final.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)
    partial.rename(final)
    _fsync_dir(root)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories, oldest first (partial ones are never listed)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if path.is_dir() and _STEP_DIR.match(path.name)]
    return sorted(found, key=lambda path: int(_STEP_DIR.match(path.name).group(1)))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """trainer_state.json of a checkpoint (step, data position, run config) without loading tensors."""
    state_file = Path(path) / TRAINER_STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{path} has no {TRAINER_STATE_FILE}; it is not a training checkpoint.")
    return json.loads(state_file.read_text())


def load_train_checkpoint(
    *,
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    restore_rng: bool = True,
) -> TrainCheckpoint:
    """Load weights (and optimizer/scheduler/RNG when given) in place; return step and data position."""
    path = Path(path)
    state = read_trainer_state(path)
    missing, unexpected = load_model(model, str(path / WEIGHTS_FILE), strict=False)
    # Buffers such as rotary tables are not persisted; only real parameters must match.
    missing_parameters = [name for name in missing if name in dict(model.named_parameters())]
    if missing_parameters or unexpected:
        raise CheckpointError(
            f"{path / WEIGHTS_FILE} does not match the model: missing {missing_parameters}, unexpected "
            f"{unexpected}. Resume with the same model config the run was started with."
        )
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    if restore_rng:
        tensors = torch.load(path / "rng.pt", weights_only=True)
        restore_rng_state({**state["rng"], **tensors})
    return TrainCheckpoint(
        path=path,
        step=int(state["step"]),
        data_position=state["data_position"],
        run_config=state["run_config"],
        metrics=state.get("metrics", {}),
    )


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(item) for item in value]
    return value


def _tuplify(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuplify(item) for item in value)
    return value
