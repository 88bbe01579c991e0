"""Experiment pages, services, monitor (real driver process), websocket dashboard and benchmarks."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import threading
import time

import pytest
import websockets
from django.core.management import call_command
from django.urls import reverse

from webapp.accounts.services import api_token_get_or_create
from webapp.experiments import services
from webapp.experiments.models import BenchmarkRun, Experiment, ExperimentRollout, ExperimentStep


@pytest.fixture
def state_dir(settings, tmp_path):
    settings.STATE_DIR = tmp_path
    return tmp_path


def _small_config(checkpoint: str, **changes) -> dict:
    return {
        "init_checkpoint": checkpoint,
        "steps": 2,
        "tasks": 2,
        "group_size": 2,
        "groups_per_step": 1,
        "max_staleness": 1,
        "rollout_workers": 2,
        "max_turns": 1,
        "max_tokens_per_turn": 8,
        "ray_num_cpus": 1,
        **changes,
    }


def test_launch_form_is_generated_from_the_typed_config(client, owner):
    client.force_login(owner)
    page = client.get(reverse("experiments:experiment-list")).content.decode()
    for name in ("max_staleness", "group_size", "rollout_workers", "init_checkpoint"):
        assert f'name="{name}"' in page
    assert "Largest policy-version lag between generating a sample and training on it" in page
    assert 'name="run_dir"' not in page  # set by the server, never by the user


def test_invalid_config_explains_the_fix_and_creates_nothing(client, owner, policy_checkpoint, state_dir):
    client.force_login(owner)
    data = {"name": "bad", **_small_config(policy_checkpoint, group_size=1)}
    response = client.post(reverse("experiments:experiment-list"), data)
    assert response.status_code == 400
    assert 'data-error-for="group_size"' in response.content.decode()
    assert "group_size must be &gt;= 2" in response.content.decode()
    response = client.post(
        reverse("experiments:experiment-list"), {**data, "group_size": 2, "init_checkpoint": "/nope"}
    )
    assert 'data-error-for="init_checkpoint"' in response.content.decode()
    response = client.post(
        reverse("experiments:experiment-list"), {**data, "group_size": 2, "negative_advantage_weight": 2}
    )
    assert response.status_code == 400
    assert 'data-error-for="negative_advantage_weight"' in response.content.decode()
    assert "1 is GRPO, 0 keeps only rollouts better than their group" in response.content.decode()
    assert not Experiment.objects.exists()


def test_launch_enqueues_after_commit_and_permissions_hold(
    client, owner, teammate, outsider, team, policy_checkpoint, state_dir, django_capture_on_commit_callbacks
):
    client.force_login(owner)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = client.post(
            reverse("experiments:experiment-list"), {"name": "first", **_small_config(policy_checkpoint)}
        )
    experiment = Experiment.objects.get()
    assert response.status_code == 302 and len(callbacks) == 1
    assert experiment.status == "queued" and experiment.config["max_staleness"] == 1
    experiment.team = team
    experiment.save()

    detail = reverse("experiments:experiment-detail", args=[experiment.pk])
    client.force_login(outsider)
    assert client.get(detail).status_code == 404
    client.force_login(teammate)
    assert client.get(detail).status_code == 200
    assert client.post(reverse("experiments:experiment-pause", args=[experiment.pk])).status_code == 404

    client.force_login(owner)
    with django_capture_on_commit_callbacks(execute=False):
        response = client.post(
            reverse("experiments:experiment-clone", args=[experiment.pk]),
            {"name": "clone", **_small_config(policy_checkpoint, max_staleness=3)},
        )
    clone = Experiment.objects.get(name="clone")
    assert (
        clone.parent == experiment
        and clone.config["max_staleness"] == 3
        and clone.run_dir != experiment.run_dir
    )

    client.post(reverse("experiments:experiment-cancel", args=[experiment.pk]))
    experiment.refresh_from_db()
    assert experiment.status == "cancelled"
    assert services.experiment_monitor(experiment_id=experiment.pk).endswith("nothing to do")


def test_pause_before_the_driver_starts_then_resume(
    owner, policy_checkpoint, state_dir, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=False):
        experiment = services.experiment_create(
            owner=owner, name="p", config=_small_config(policy_checkpoint)
        )
        services.experiment_pause(experiment=experiment)
    assert services.experiment_monitor(experiment_id=experiment.pk) == "paused"
    experiment.refresh_from_db()
    assert experiment.status == "paused" and experiment.launches == 0
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        services.experiment_resume(experiment=experiment)
    experiment.refresh_from_db()
    assert experiment.status == "queued" and not experiment.pause_requested and len(callbacks) == 2


def _wait_for_checkpoint(run_dir: str, version: int) -> None:
    from training.rollout.driver import checkpointed_version

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and checkpointed_version(run_dir) < version:
        time.sleep(0.2)


def _kill_a_rollout_worker_then_the_driver(run_dir: str, killed: threading.Event) -> None:
    """SIGKILL one rollout worker after the first checkpoint, then the driver's process group after the
    second (unless it already finished); `killed` says the driver was killed."""
    from training.rollout.driver import checkpointed_version, read_status

    _wait_for_checkpoint(run_dir, 1)
    os.kill(read_status(run_dir)["rollout_worker_pids"][0], signal.SIGKILL)
    _wait_for_checkpoint(run_dir, 2)
    pid = read_status(run_dir).get("pid")
    if pid and checkpointed_version(run_dir) < 4:
        os.killpg(pid, signal.SIGKILL)
        killed.set()


def _monitor_in_thread(experiment_id: int) -> str:
    from django.db import connection

    try:
        return services.experiment_monitor(experiment_id=experiment_id)
    finally:
        connection.close()  # the thread's own connection, or the test database cannot be dropped


async def _watch_until_finished(asgi_server: str, experiment_id: int, token: str):
    """Subscribe to the experiment's socket, run the monitor to its end, and collect every message up
    to the "finished" status: (first snapshot, the monitor's note, the messages after the snapshot)."""
    headers = {"Authorization": f"Token {token}", "Origin": "http://127.0.0.1"}
    async with websockets.connect(
        f"ws://{asgi_server}/ws/experiments/{experiment_id}/", additional_headers=headers
    ) as ws:
        snapshot = json.loads(await asyncio.wait_for(ws.recv(), timeout=15))
        note = await asyncio.to_thread(_monitor_in_thread, experiment_id)
        received = []
        while not any(m.get("kind") == "status" and m.get("status") == "finished" for m in received):
            received.append(json.loads(await asyncio.wait_for(ws.recv(), timeout=15)))
        return snapshot, note, received


def _assert_every_rollout_counted_once(experiment: Experiment, policy_checkpoint: str) -> list:
    """Four steps, eight distinct rollouts in groups of two, each counted once by the final checkpoint;
    ingesting again adds nothing. Returns the rollouts."""
    from training.checkpoint import load_checkpoint
    from training.train.state import latest_checkpoint, load_train_checkpoint

    steps = list(ExperimentStep.objects.filter(experiment=experiment).values_list("step", flat=True))
    assert steps == [1, 2, 3, 4]
    rollouts = list(ExperimentRollout.objects.filter(experiment=experiment))
    assert len(rollouts) == 8 and len({r.rollout_id for r in rollouts}) == 8
    groups = {r.group_id for r in rollouts}
    assert all(sum(r.group_id == group for r in rollouts) == 2 for group in groups)
    assert all(0 <= r.staleness <= 1 for r in rollouts)
    model, _, _ = load_checkpoint(policy_checkpoint)
    final = load_train_checkpoint(path=latest_checkpoint(experiment.run_dir), model=model, restore_rng=False)
    assert final.data_position["version"] == 4
    assert sorted(final.data_position["counted_groups"]) == sorted(groups)
    assert all(r.trace is not None and r.trace.source == "training" for r in rollouts)
    assert experiment.checkpoints.count() >= 2
    assert services.experiment_ingest(experiment=experiment) == 0  # idempotent
    return rollouts


@pytest.mark.django_db(transaction=True)
def test_monitor_survives_killed_worker_and_driver_without_double_counting_and_streams_steps(
    owner, outsider, policy_checkpoint, state_dir, asgi_server, client
):
    experiment = Experiment.objects.create(
        owner=owner,
        name="live",
        config=_small_config(policy_checkpoint, steps=4),
        run_dir=str(state_dir / "experiments" / "live"),
    )
    token = api_token_get_or_create(user=owner)
    killed = threading.Event()
    threading.Thread(
        target=_kill_a_rollout_worker_then_the_driver, args=(experiment.run_dir, killed), daemon=True
    ).start()

    snapshot, note, received = asyncio.run(_watch_until_finished(asgi_server, experiment.pk, token))
    assert snapshot["kind"] == "snapshot" and snapshot["steps"] == []
    assert note == "finished"
    streamed = [
        step["step"] for message in received if message["kind"] == "steps" for step in message["steps"]
    ]
    assert sorted(streamed) == [1, 2, 3, 4]

    experiment.refresh_from_db()
    assert killed.is_set(), "the driver finished before it could be killed"
    # The monitor saw the driver die and started it again; it resumed from its checkpoint.
    assert experiment.status == "finished" and experiment.current_step == 4 and experiment.launches == 2
    rollouts = _assert_every_rollout_counted_once(experiment, policy_checkpoint)

    client.force_login(owner)
    group_url = reverse("experiments:experiment-group", args=[experiment.pk, rollouts[0].group_id])
    group = client.get(group_url)
    assert group.status_code == 200
    assert reverse("agents:task-detail", args=[rollouts[0].trace_id]) in group.content.decode()
    page = client.get(reverse("experiments:experiment-detail", args=[experiment.pk])).content.decode()
    assert "initial-series" in page and "Evaluate" in page
    client.force_login(outsider)
    assert client.get(group_url).status_code == 404


@pytest.mark.django_db(transaction=True)
def test_an_experiment_with_a_time_budget_finishes_when_it_is_spent(owner, policy_checkpoint, state_dir):
    """The driver stops itself short of its 1,000 steps when its 45-second budget is spent; the monitor
    marks the experiment finished instead of relaunching a driver that would train nothing."""
    experiment = Experiment.objects.create(
        owner=owner,
        name="budget",
        config=_small_config(policy_checkpoint, steps=1000, time_budget_minutes=0.75, tasks=500),
        run_dir=str(state_dir / "experiments" / "budget"),
    )
    assert services.experiment_monitor(experiment_id=experiment.pk) == "finished"
    experiment.refresh_from_db()
    assert experiment.status == "finished" and experiment.status_reason == "time budget spent"
    assert experiment.launches == 1 and 1 <= experiment.current_step < 1000
    assert ExperimentStep.objects.filter(experiment=experiment).count() == experiment.current_step


def test_bench_command_stores_result_on_leaderboard(client, owner, outsider, state_dir):
    call_command(
        "bench", suite="toy-heldout-2", policy="scripted", attempts=2, temperature=0.5, owner=owner.username
    )
    run = BenchmarkRun.objects.get()
    assert run.status == "finished" and run.summary["pass_at_1"] == 1.0 and run.summary["pass_at_k"] == 1.0
    assert run.task_results.count() == 2 and all(row.passes == 2 for row in run.task_results.all())
    client.force_login(owner)
    page = client.get(reverse("experiments:benchmarks")).content.decode()
    assert "<td>toy-heldout-2</td>" in page and "Scripted reference fix" in page
    client.force_login(outsider)
    assert "<td>toy-heldout-2</td>" not in client.get(reverse("experiments:benchmarks")).content.decode()
    with pytest.raises(Exception, match="unknown suite"):
        call_command("bench", suite="nope", policy="scripted", owner=owner.username)


def test_the_validation_suite_shares_no_task_with_any_heldout_suite():
    from training.bench.runner import MAX_SUITE_TASKS, BenchConfigError, suite_tasks, suite_tasks_count

    validation = suite_tasks("toy-validation-3")
    assert [task.split for task in validation] == ["heldout"] * 3
    heldout_suite = {task.task_id for task in suite_tasks("toy-heldout-3")}
    assert not heldout_suite & {task.task_id for task in validation}
    # toy-heldout-N takes the first N held-out tasks; the largest allowed N ends before validation begins.
    first_seed = int(validation[0].task_id.removeprefix("toy-"))
    last_heldout_seed = int(suite_tasks("toy-heldout-1")[0].task_id.removeprefix("toy-")) + MAX_SUITE_TASKS - 1
    assert first_seed > last_heldout_seed
    assert suite_tasks_count("toy-validation-50") == ("validation", 50)
    with pytest.raises(BenchConfigError, match="toy-validation-N"):
        suite_tasks_count("toy-valid-5")


def test_pass_at_k_and_wilson_interval():
    from training.bench.runner import pass_at_k, wilson_interval

    assert pass_at_k(n=4, c=0, k=1) == 0.0 and pass_at_k(n=4, c=4, k=2) == 1.0
    assert pass_at_k(n=4, c=1, k=1) == pytest.approx(0.25)
    assert pass_at_k(n=4, c=1, k=2) == pytest.approx(0.5)
    low, high = wilson_interval(5, 10)
    assert low < 0.5 < high and high - low < 0.6


def test_paired_difference_interval():
    from training.bench.runner import BenchConfigError, paired_pass_at_1_difference

    def rows(passes, attempts=4):
        return [{"task_id": f"t{i}", "attempts": attempts, "passes": c} for i, c in enumerate(passes)]

    # The same outcome on every task: no difference and no spread.
    assert paired_pass_at_1_difference(rows([0, 2, 4]), rows([0, 2, 4])) == (0.0, 0.0, 0.0, 3)
    # Every task gains one pass in four: +0.25 exactly, however different the tasks are.
    difference, low, high, n = paired_pass_at_1_difference(rows([0, 1, 3, 2]), rows([1, 2, 4, 3]))
    assert (difference, low, high, n) == (pytest.approx(0.25), pytest.approx(0.25), pytest.approx(0.25), 4)
    # d = (+0.5, 0, -0.25, +0.75): mean 0.25, sd 0.4564 -> half-width 1.96 * 0.4564 / 2.
    difference, low, high, _ = paired_pass_at_1_difference(rows([0, 2, 3, 1]), rows([2, 2, 2, 4]))
    assert difference == pytest.approx(0.25)
    assert high - difference == pytest.approx(1.96 * math.sqrt(0.2083333) / 2, rel=1e-4)
    # Tasks with no scored attempt on either side (infrastructure failures only) are left out.
    after = rows([1, 2, 4, 3])
    after[0]["attempts"] = 0
    assert paired_pass_at_1_difference(rows([0, 1, 3, 2]), after)[3] == 3
    with pytest.raises(BenchConfigError, match="at least 2 tasks"):
        paired_pass_at_1_difference(rows([1]), rows([1]))


def test_paired_task_changes_say_where_a_gain_comes_from():
    from training.bench.runner import BenchConfigError, paired_task_changes

    def rows(passes, attempts=4):
        return [{"task_id": f"t{i}", "attempts": attempts, "passes": c} for i, c in enumerate(passes)]

    kinds = {"t0": "off_by_one", "t1": "off_by_one", "t2": "compare_swap", "t3": "off_by_one", "t4": "compare_swap"}
    changes = paired_task_changes(rows([0, 2, 4, 1, 0]), rows([0, 4, 3, 1, 2]), kinds)
    assert (changes["tasks"], changes["up"], changes["down"], changes["same"]) == (5, 2, 1, 2)
    assert changes["all_passed"] == [1, 1] and changes["none_passed"] == [2, 1]
    assert changes["none_passed_in_both"] == 1
    # Kinds come most tasks first; pass@1 is the mean over the kind's tasks on each side.
    assert list(changes["by_kind"]) == ["off_by_one", "compare_swap"]
    off_by_one = changes["by_kind"]["off_by_one"]
    assert off_by_one["tasks"] == 3 and off_by_one["none_passed_in_both"] == 1
    assert off_by_one["pass_at_1"] == [pytest.approx(0.25), pytest.approx(5 / 12)]
    assert changes["by_kind"]["compare_swap"]["pass_at_1"] == [pytest.approx(0.5), pytest.approx(0.625)]
    # A task scored on one side only is left out, as in the paired interval.
    after = rows([0, 4, 3, 1, 2])
    after[4]["attempts"] = 0
    assert paired_task_changes(rows([0, 2, 4, 1, 0]), after, kinds)["by_kind"]["compare_swap"]["tasks"] == 1
    with pytest.raises(BenchConfigError, match="no bug kind"):
        paired_task_changes(rows([0, 1]), rows([1, 1]), {"t0": "off_by_one"})


def test_bench_learning_compare_and_baseline(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    def summary(passes):
        rows = [{"task_id": f"t{i}", "attempts": 4, "passes": c} for i, c in enumerate(passes)]
        return {"pass_at_1": sum(passes) / (4 * len(passes)), "per_task": rows}

    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(json.dumps(summary([0, 2, 3, 1])))
    after.write_text(json.dumps(summary([2, 2, 2, 4])))
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_learning.py"
    out = subprocess.run(
        [sys.executable, str(script), "--compare", str(before), str(after)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    # d = (+0.5, 0, -0.25, +0.75): +25 points, half-width 1.96 * 0.4564 / 2 = 44.7 points.
    assert "pass@1 0.375 -> 0.625: +25.0 points, paired 95% CI [-19.7, +69.7] over 4 tasks" in out
    assert "changes by bug kind left out" in out

    # Evaluation outputs name their suite, so the comparison also says which tasks and bug kinds moved.
    from training.bench.runner import suite_tasks

    tasks = suite_tasks("toy-heldout-4")
    for path, passes in ((before, [0, 2, 3, 1]), (after, [2, 2, 2, 4])):
        evaluated = summary(passes) | {"config": {"suite": "toy-heldout-4"}}
        for row, task in zip(evaluated["per_task"], tasks, strict=True):
            row["task_id"] = task.task_id
        path.write_text(json.dumps(evaluated))
    out = subprocess.run(
        [sys.executable, str(script), "--compare", str(before), str(after)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    assert "tasks up / down / same: 2 / 1 / 1; all attempts passed 0 -> 1; none passed 1 -> 0 (0 in both)" in out
    assert f"  {tasks[0].mutation_kind:<18}" in out

    # A stored baseline made with other settings is refused, saying what differs, before any training.
    stored = summary([1, 1]) | {"config": {"suite": "toy-heldout-2", "policy": "checkpoint:ckpt", "attempts": 4,
                                          "max_turns": 5, "max_tokens_per_turn": 256, "temperature": 1.0,
                                          "disable_tools": [], "copy_constraint": True}}
    before.write_text(json.dumps(stored))
    refused = subprocess.run(
        [sys.executable, str(script), "--init-checkpoint", "ckpt", "--baseline", str(before), "--heldout", "2",
         "--attempts", "4", "--max-turns", "5", "--temperature", "0.8"],
        capture_output=True, text=True, timeout=120,
    )
    assert refused.returncode != 0 and "'temperature': 1.0" in refused.stderr and "'temperature': 0.8" in refused.stderr
    # ... and so is one evaluated with old_str sampled freely, for a run that constrains it (the default)
    stored["config"] |= {"temperature": 0.8, "copy_constraint": False}
    before.write_text(json.dumps(stored))
    refused = subprocess.run(
        [sys.executable, str(script), "--init-checkpoint", "ckpt", "--baseline", str(before), "--heldout", "2",
         "--attempts", "4", "--max-turns", "5", "--temperature", "0.8"],
        capture_output=True, text=True, timeout=120,
    )
    assert refused.returncode != 0 and "'copy_constraint': False" in refused.stderr


def test_demo_seed_is_idempotent(owner, state_dir):
    from webapp.experiments.demo import demo_seed

    first = demo_seed(user=owner)
    assert "pass@1 1.0" in first
    assert "already present" in demo_seed(user=owner)
    assert BenchmarkRun.objects.filter(owner=owner).count() == 1


def test_evaluate_checkpoint_from_the_page(
    client, owner, teammate, team, policy_checkpoint, state_dir, django_capture_on_commit_callbacks
):
    from webapp.experiments.models import ExperimentCheckpoint

    experiment = Experiment.objects.create(
        owner=owner, team=team, name="evaluated", config=_small_config(policy_checkpoint)
    )
    checkpoint = ExperimentCheckpoint.objects.create(experiment=experiment, step=1, path=policy_checkpoint)
    url = reverse("experiments:checkpoint-evaluate", args=[experiment.pk, checkpoint.pk])
    client.force_login(teammate)
    assert client.post(url, {"suite": "toy-heldout-2", "attempts": 1}).status_code == 404
    client.force_login(owner)
    response = client.post(url, {"suite": "no-such-suite", "attempts": 1})
    assert response.status_code == 302 and not BenchmarkRun.objects.exists()
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        client.post(url, {"suite": "toy-heldout-2", "attempts": 1})
    run = BenchmarkRun.objects.get()
    assert len(callbacks) == 1 and run.checkpoint == checkpoint and run.policy_kind == "checkpoint"
    run = services.benchmark_run_execute(run_id=run.pk, options={"max_turns": 1, "max_tokens_per_turn": 8})
    assert run.status == "finished" and run.summary["scored_tasks"] == 2
    assert run.summary["pass_at_1"] == 0.0  # a random model fixes nothing; the row still lands on the board
    page = client.get(reverse("experiments:benchmarks")).content.decode()
    assert "evaluated @ step 1" in page


def test_api_launch_list_and_control(
    api_client_for, owner, outsider, policy_checkpoint, state_dir, django_capture_on_commit_callbacks
):
    api = api_client_for(owner)
    bad = api.post(
        "/api/experiments/",
        {"name": "x", "config": {"group_size": 1, "init_checkpoint": policy_checkpoint}},
        format="json",
    )
    assert bad.status_code == 400 and "group_size must be >= 2" in json.dumps(bad.json())
    forbidden = api.post("/api/experiments/", {"name": "x", "config": {"run_dir": "/etc"}}, format="json")
    assert forbidden.status_code == 400 and "set by the server" in json.dumps(forbidden.json())
    with django_capture_on_commit_callbacks(execute=False):
        created = api.post(
            "/api/experiments/", {"name": "api", "config": _small_config(policy_checkpoint)}, format="json"
        )
    assert created.status_code == 201
    pk = created.json()["id"]
    assert [row["id"] for row in api.get("/api/experiments/").json()] == [pk]
    assert api_client_for(outsider).get(f"/api/experiments/{pk}/").status_code == 404
    assert api_client_for(outsider).post(f"/api/experiments/{pk}/cancel/").status_code == 404
    assert api.post(f"/api/experiments/{pk}/explode/").status_code == 400
    assert api.post(f"/api/experiments/{pk}/cancel/").json()["status"] == "cancelled"
    assert api.post(f"/api/experiments/{pk}/pause/").status_code == 409  # the state forbids it, not the input
    assert api.get(f"/api/experiments/{pk}/").json()["steps"] == []


def test_benchmark_without_a_tool_never_offers_it(owner, state_dir):
    from training.bench.runner import ToolSubsetPolicy
    from training.tasks.toy import generate_toy_task
    from training.train.scripted_expert import toy_expert_policy

    offered = []

    class Recorder:
        name = "recorder"

        def __init__(self, policy):
            self.policy = policy

        def complete(self, *, tools, **kwargs):
            offered.append({tool["function"]["name"] for tool in tools})
            return self.policy.complete(tools=tools, **kwargs)

    from sandboxes.tools import openai_tool_schemas

    policy = ToolSubsetPolicy(Recorder(toy_expert_policy(generate_toy_task(1))), ("semantic_search",))
    policy.complete(
        messages=[{"role": "user", "content": "x"}],
        tools=openai_tool_schemas(),
        max_tokens=16,
        temperature=0.0,
        top_p=1.0,
        timeout_s=5,
    )
    assert offered and "semantic_search" not in offered[0] and "read_file" in offered[0]

    call_command(
        "bench",
        suite="toy-heldout-1",
        policy="scripted",
        owner=owner.username,
        exclude_tools="semantic_search",
    )
    run = BenchmarkRun.objects.get()
    assert run.policy_label == "scripted (without semantic_search)" and run.summary["pass_at_1"] == 1.0
    assert run.summary["options"]["exclude_tools"] == ["semantic_search"]
    with pytest.raises(Exception, match="unknown tools"):
        call_command(
            "bench", suite="toy-heldout-1", policy="scripted", owner=owner.username, exclude_tools="nope"
        )


def test_benchmark_with_a_disabled_tool_keeps_the_prompt_and_counts_calls(owner, state_dir):
    call_command("bench", suite="toy-heldout-1", policy="scripted", owner=owner.username, disable_tools="run_terminal")
    run = BenchmarkRun.objects.get()
    assert run.policy_label == "scripted (run_terminal disabled)"
    assert run.summary["options"]["disable_tools"] == ["run_terminal"]
    calls = run.summary["calls_by_tool"]
    assert calls and sum(calls.values()) > 0 and "read_file" in calls
    # the refused run_terminal call is counted as failed; the expert's read and edit succeeded
    assert run.summary["failed_calls_by_tool"] == {"run_terminal": calls["run_terminal"]}
    with pytest.raises(Exception, match="disable_tools names unknown tools"):
        call_command("bench", suite="toy-heldout-1", policy="scripted", owner=owner.username, disable_tools="nope")


def test_abandoned_groups_are_ingested_and_labelled_on_the_pages(client, owner, outsider, state_dir):
    """A probed run logs the groups it abandoned beside the trained ones; the pages say which is which."""
    run_dir = state_dir / "experiments" / "probed"
    (run_dir / "checkpoints" / "step-00000001").mkdir(parents=True)
    experiment = Experiment.objects.create(
        owner=owner, name="probed", config={"group_size": 4, "probe_size": 2}, run_dir=str(run_dir)
    )

    def row(group: str, index: int, *, passed: bool, abandoned: bool, advantage: float) -> dict:
        return {
            "step": 1, "abandoned": abandoned, "rollout_id": f"{group}/s{index}", "group_id": group,
            "task_id": f"toy-{group}", "sample_index": index, "valid": True, "reward": float(passed),
            "passed": passed, "status": "succeeded" if passed else "failed", "advantage": advantage,
            "completion_tokens": 10, "turns": 1, "policy_version": 0, "staleness": 1,
            "tools_used": {}, "tool_calls": 0, "group_position": 0,
        }

    trained = [row("group-000001", i, passed=i % 2 == 0, abandoned=False, advantage=0.5 - (i % 2)) for i in range(4)]
    abandoned = [row("group-000000", i, passed=False, abandoned=True, advantage=0.0) for i in range(2)]
    (run_dir / "rollouts.jsonl").write_text("".join(json.dumps(item) + "\n" for item in trained + abandoned))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "abandoned_groups": 1, "pass_rate": 0.5}) + "\n")

    assert services.experiment_ingest(experiment=experiment) == 1
    stored = {r.rollout_id: r.abandoned for r in ExperimentRollout.objects.filter(experiment=experiment)}
    assert stored == {**{f"group-000001/s{i}": False for i in range(4)}, **{f"group-000000/s{i}": True for i in range(2)}}

    client.force_login(owner)
    detail = client.get(reverse("experiments:experiment-detail", args=[experiment.pk])).content.decode()
    assert detail.count("(abandoned after its probe)") == 1
    abandoned_page = client.get(reverse("experiments:experiment-group", args=[experiment.pk, "group-000000"]))
    assert "abandoned</strong> after its probe rollouts all earned the same reward" in abandoned_page.content.decode()
    trained_page = client.get(reverse("experiments:experiment-group", args=[experiment.pk, "group-000001"]))
    assert "trained at step 1" in trained_page.content.decode()
    client.force_login(outsider)
    assert client.get(reverse("experiments:experiment-group", args=[experiment.pk, "group-000000"])).status_code == 404
