"""Exact resume: a pretraining run SIGKILLed mid-run and restarted continues with identical losses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from training.train.state import (
    capture_rng_state,
    latest_checkpoint,
    list_checkpoints,
    load_train_checkpoint,
    restore_rng_state,
    save_train_checkpoint,
)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from training.tokenizer import default_tokenizer

    return default_tokenizer(2048).save(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")


def _pretrain_command(run_dir: Path, tokenizer_file: Path) -> list[str]:
    return [
        sys.executable, "manage.py", "pretrain", "--run-dir", str(run_dir), "--tokenizer", str(tokenizer_file),
        "--steps", str(STEPS), "--batch-size", "8", "--micro-batch-size", "4", "--seq-len", "96",
        "--corpus-max-bytes", "150000", "--checkpoint-every", "1", "--keep-checkpoints", "2", "--warmup-steps", "3",
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _losses_by_step(run_dir: Path) -> dict[int, float]:
    losses: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        entry = json.loads(line)
        losses[entry["step"]] = entry["loss"]  # a resumed run's entry replaces the killed run's
    return losses


def test_sigkilled_run_resumes_with_identical_next_step_loss(tmp_path, tokenizer_file):
    reference_dir, victim_dir = tmp_path / "reference", tmp_path / "victim"
    subprocess.run(_pretrain_command(reference_dir, tokenizer_file), cwd=ROOT, env=_env(), check=True,
                   capture_output=True, timeout=300)
    reference = _losses_by_step(reference_dir)
    assert sorted(reference) == list(range(1, STEPS + 1))

    victim = subprocess.Popen(_pretrain_command(victim_dir, tokenizer_file), cwd=ROOT, env=_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and victim.poll() is None:
            checkpoints = list_checkpoints(victim_dir)
            if checkpoints and int(checkpoints[-1].name.split("-")[1]) >= 3:
                break
            time.sleep(0.01)
        victim.send_signal(signal.SIGKILL)
    finally:
        victim.wait(timeout=30)
    assert victim.returncode == -signal.SIGKILL, victim.stderr.read().decode()[-2000:]
    killed_at = int(latest_checkpoint(victim_dir).name.split("-")[1])
    assert 3 <= killed_at < STEPS, "the run finished before it could be killed; the test needs a mid-run kill"

    resumed = subprocess.run(_pretrain_command(victim_dir, tokenizer_file), check=False, cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first_resumed_line = json.loads(resumed.stdout.splitlines()[0])
    assert first_resumed_line["step"] == killed_at + 1
    # The very next step after the resume, then every step after it, match the uninterrupted run.
    assert first_resumed_line["loss"] == pytest.approx(reference[killed_at + 1], abs=1e-6)
    resumed_losses = _losses_by_step(victim_dir)
    for step in range(killed_at + 1, STEPS + 1):
        assert resumed_losses[step] == pytest.approx(reference[step], abs=1e-6), step


def test_crash_mid_save_leaves_previous_checkpoint(tmp_path, tokenizer_file):
    from training.model.config import ModelConfig
    from training.model.transformer import MoETransformer
    from training.tokenizer import load_tokenizer
    from training.train.loop import OptimizerConfig, build_optimizer, build_scheduler

    tokenizer = load_tokenizer(tokenizer_file)
    model = MoETransformer(ModelConfig.named("tiny", n_layers=1))
    optimizer = build_optimizer(model, OptimizerConfig())
    scheduler = build_scheduler(optimizer, OptimizerConfig(), total_steps=10)
    kwargs = {"run_dir": tmp_path, "model": model, "tokenizer": tokenizer, "optimizer": optimizer,
              "scheduler": scheduler, "run_config": {}}
    save_train_checkpoint(step=1, data_position={"samples_seen": 8}, **kwargs)
    # What a process killed while writing step 2 leaves behind: a partial directory with some files.
    partial = tmp_path / "checkpoints" / ".partial-step-00000002-deadbeef"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\x00" * 100)
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    restored = load_train_checkpoint(path=latest_checkpoint(tmp_path), model=model, optimizer=optimizer)
    assert restored.step == 1 and restored.data_position == {"samples_seen": 8}
    # The next save cleans the debris and pruning keeps only the newest keep_last.
    for step in (2, 3):
        save_train_checkpoint(step=step, data_position={"samples_seen": 8 * step}, keep_last=2, **kwargs)
    names = sorted(path.name for path in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000002", "step-00000003"]


def test_training_checkpoint_is_a_servable_model_checkpoint(tmp_path, tokenizer_file):
    from training.checkpoint import load_checkpoint
    from training.model.config import ModelConfig
    from training.model.transformer import MoETransformer
    from training.tokenizer import load_tokenizer
    from training.train.loop import OptimizerConfig, build_optimizer, build_scheduler

    model = MoETransformer(ModelConfig.named("tiny", n_layers=1))
    optimizer = build_optimizer(model, OptimizerConfig())
    path = save_train_checkpoint(
        run_dir=tmp_path, step=5, model=model, tokenizer=load_tokenizer(tokenizer_file), optimizer=optimizer,
        scheduler=build_scheduler(optimizer, OptimizerConfig(), total_steps=10), data_position={"samples_seen": 0},
        run_config={},
    )
    loaded, _, meta = load_checkpoint(path)
    assert meta["step"] == 5
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_rng_state_round_trip():
    import random

    state = capture_rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.random(), np.random.rand(), torch.rand(3)
    restore_rng_state(json.loads(json.dumps({k: v for k, v in state.items() if k != "torch"})) | {"torch": state["torch"]})
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
