"""Ray single-controller driver config checks.

The driver itself runs end to end (real local Ray, real sandboxes, a rollout worker and then the
driver killed mid-run, resume without double counting) in test_experiment_pages.py
(test_monitor_survives_killed_worker_and_driver_without_double_counting_and_streams_steps).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from training.checkpoint import create_random_checkpoint
from training.rollout.driver import AsyncRLConfig, AsyncRLConfigError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return create_random_checkpoint(tmp_path_factory.mktemp("policy"), "tiny", seed=0, max_seq_len=4096)


def test_config_errors_explain_the_fix(checkpoint, tmp_path):
    with pytest.raises(AsyncRLConfigError, match="group_size must be >= 2"):
        AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(checkpoint), group_size=1)
    with pytest.raises(AsyncRLConfigError, match="lower inference_actors"):
        AsyncRLConfig(
            run_dir=str(tmp_path), init_checkpoint=str(checkpoint), rollout_workers=1, inference_actors=2
        )
    with pytest.raises(AsyncRLConfigError, match=r"negative_advantage_weight=2.0 must lie in \[0, 1\]"):
        AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(checkpoint), negative_advantage_weight=2.0)
    with pytest.raises(AsyncRLConfigError, match=r"entropy_coef=1.5 must lie in \(-1, 1\)"):
        AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(checkpoint), entropy_coef=1.5)
    with pytest.raises(AsyncRLConfigError, match=r"entropy_scope='wrong'; use 'all'"):
        AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(checkpoint), entropy_scope="wrong")
    with pytest.raises(AsyncRLConfigError, match=r"kl_coef=-0.1 must lie in \[0, 1\)"):
        AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(checkpoint), kl_coef=-0.1)
    with pytest.raises(AsyncRLConfigError, match=r"warmup_steps must be >= 0 \(0 starts at the full lr\)"):
        AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(checkpoint), warmup_steps=-1)
    with pytest.raises(AsyncRLConfigError, match=r"min_lr_ratio must be in \[0, 1\] \(1 keeps lr constant\)"):
        AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(checkpoint), min_lr_ratio=1.5)
    with pytest.raises(AsyncRLConfigError, match=r"lr_decay_fraction must be in \(0, 1\]"):
        AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(checkpoint), lr_decay_fraction=0.0)
    with pytest.raises(AsyncRLConfigError, match=r"time_budget_minutes must be > 0 \(leave it empty"):
        AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(checkpoint), time_budget_minutes=0.0)
    with pytest.raises(AsyncRLConfigError, match=r"probe_size must be 0 \(no probing\) or between 2 and group_size - 1 = 3"):
        AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(checkpoint), group_size=4, probe_size=4)
    assert AsyncRLConfig(
        run_dir=str(tmp_path), init_checkpoint=str(checkpoint), group_size=8, probe_size=4
    ).scheduler_config.probe_size == 4
    with pytest.raises(AsyncRLConfigError, match=r"reference_similarity_weight must be in \[0, 1\)"):
        AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(checkpoint), reference_similarity_weight=1.0)
    with pytest.raises(AsyncRLConfigError, match="not a checkpoint directory"):
        AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(tmp_path / "missing"))
    with pytest.raises(AsyncRLConfigError, match="unknown AsyncRLConfig fields"):
        AsyncRLConfig.from_dict({"run_dir": "x", "init_checkpoint": str(checkpoint), "stepz": 3})


def test_rollouts_run_on_fleet_sandbox_hosts_and_the_lr_schedule_follows_versions(checkpoint, tmp_path):
    """Real steps whose sandboxes live on the fleet's sandbox-host actors (private local Ray). A random
    policy never passes, so its groups agree and no update trains; the lr still decays per version, or a
    clock-stopped run whose groups often agree would end before its decay began."""
    from training.rollout.driver import METRICS_FILE, ROLLOUTS_FILE, read_jsonl, run_async_rl

    config = AsyncRLConfig(
        run_dir=str(tmp_path / "run"),
        init_checkpoint=str(checkpoint),
        steps=3,
        lr=1e-3,
        min_lr_ratio=0.1,
        tasks=2,
        group_size=2,
        groups_per_step=1,
        max_staleness=0,
        rollout_workers=2,
        max_turns=1,
        max_tokens_per_turn=8,
        ray_num_cpus=1,
        sandbox_hosts=True,
        fleet_heartbeats=False,
        kl_coef=0.05,  # loads the reference policy; with no trained update there is no KL to report
    )
    history = run_async_rl(config)
    assert [row["step"] for row in history] == [1, 2, 3]
    rows = read_jsonl(tmp_path / "run" / ROLLOUTS_FILE)
    assert len(rows) == 6 and all(
        row["valid"] and row["status"].startswith(("succeeded", "failed")) for row in rows
    )
    metrics = read_jsonl(tmp_path / "run" / METRICS_FILE)
    assert [row["masked_rollouts"] for row in metrics] == [0, 0, 0]
    assert [row["pass_rate"] for row in metrics] == [0.0, 0.0, 0.0]
    assert [row["kl_to_reference"] for row in metrics] == [None, None, None]
    # Cosine from lr to 0.1 lr over the 3 versions: 1, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.25.
    assert [row["lr"] for row in metrics] == pytest.approx([1e-3, 0.775e-3, 0.325e-3])


def test_a_time_budget_stops_the_run_and_ends_its_lr_decay_on_the_clock(checkpoint, tmp_path):
    """No update count ends this run: its 30-second budget does. The lr follows the clock (Ray's start
    counts, so the second update's lr is already well down a cosine over the budget, where the schedule's
    1,000 steps alone would have moved it by a millionth), and the spent budget is kept in the checkpoint,
    so starting the finished run again trains nothing."""
    from training.rollout.driver import METRICS_FILE, STATUS_FILE, read_jsonl, run_async_rl, run_finished
    from training.train.state import TRAINER_STATE_FILE, latest_checkpoint

    config = AsyncRLConfig(
        run_dir=str(tmp_path / "run"),
        init_checkpoint=str(checkpoint),
        steps=1000,
        time_budget_minutes=0.5,
        lr=1e-3,
        min_lr_ratio=0.1,
        tasks=200,
        group_size=2,
        groups_per_step=1,
        max_staleness=0,
        rollout_workers=2,
        max_turns=1,
        max_tokens_per_turn=8,
        ray_num_cpus=1,
    )
    started = time.monotonic()
    history = run_async_rl(config)
    assert 2 <= len(history) < 1000
    assert time.monotonic() - started < 30 + 60  # the budget, plus the update in progress and Ray's shutdown
    lrs = [row["lr"] for row in history]
    assert lrs[0] == pytest.approx(1e-3)
    assert lrs[1] < 0.99e-3 and all(later <= earlier for earlier, later in zip(lrs, lrs[1:], strict=False))
    status = json.loads((tmp_path / "run" / STATUS_FILE).read_text())
    last = latest_checkpoint(tmp_path / "run")
    # the update in flight when the budget ran out is finished and checkpointed, and the status counts it
    assert status["state"] == "finished" and status["version"] == len(history) == int(last.name.removeprefix("step-"))
    position = json.loads((last / TRAINER_STATE_FILE).read_text())["data_position"]
    assert position["training_seconds"] >= 30 - 5  # the last update may end just before the timer
    assert run_async_rl(config) == []
    assert len(read_jsonl(tmp_path / "run" / METRICS_FILE)) == len(history)
    assert run_finished(tmp_path / "run")  # so a monitor that relaunched it stops there


def test_the_update_takes_the_runs_objective_options(checkpoint, tmp_path):
    """Every objective option of the run reaches the trainer's update, and std-normalisation changes the
    advantages it computes: one success in a group of 16 is worth (15/16) / 0.25 = 3.75 instead of 15/16."""
    from training.rollout.driver import update_config_for
    from training.train.rl import rollout_advantages
    from training.train.rollouts import RolloutRecord

    options = dict(
        negative_advantage_weight=0.5, entropy_coef=-0.5, entropy_scope="positive", kl_coef=0.05,
        normalize_advantage_std=True,
    )
    config = AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(checkpoint), group_size=16, **options)
    update = update_config_for(config)
    assert {name: getattr(update.grpo, name) for name in options} == options
    records = [
        RolloutRecord(task_id="t", group=0, valid=True, reward=float(index == 0), passed=index == 0)
        for index in range(16)
    ]
    std_normalised = rollout_advantages(records, update.grpo)
    assert std_normalised[0].item() == pytest.approx(3.75, rel=1e-4)  # eps 1e-6 joins the std
    assert std_normalised[1].item() == pytest.approx(-0.25 * 0.5, rel=1e-4)  # (-1/16) / 0.25, times the negative weight
    plain = AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=str(checkpoint), group_size=16)
    plain_update = update_config_for(plain)
    assert rollout_advantages(records, plain_update.grpo)[0].item() == pytest.approx(15 / 16)


def test_validating_a_launch_config_does_not_import_torch(tmp_path):
    """The web process validates launch forms with AsyncRLConfig; the objective checks it shares with
    GRPOConfig must not drag torch (seconds of import, hundreds of MB) into it."""
    script = (
        "import sys\n"
        "from training.rollout.driver import AsyncRLConfig, AsyncRLConfigError\n"
        "try:\n"
        f"    AsyncRLConfig(run_dir={str(tmp_path)!r}, init_checkpoint='unused', entropy_scope='wrong')\n"
        "except AsyncRLConfigError as error:\n"
        "    print(error)\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    message, torch_imported = result.stdout.strip().splitlines()
    assert message.startswith("entropy_scope='wrong'; use 'all'")
    assert torch_imported == "False"
