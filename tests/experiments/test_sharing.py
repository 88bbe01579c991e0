"""Experiments shared with a team, like tasks: teammates read everything, only the owner acts.

Every experiment endpoint (pages, REST API, websocket) is tried as the owner, a teammate of the team
the experiment is shared with, and an outsider. Outsiders get 404 (never 403: ids are not probed),
teammates get 404 on every action, as for tasks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.urls import reverse

from webapp.agents.selectors import LIVE_CHANNEL_LAYER
from webapp.experiments import services
from webapp.experiments.consumers import ExperimentConsumer
from webapp.experiments.models import Experiment, ExperimentCheckpoint, ExperimentRollout


@pytest.fixture
def state_dir(settings, tmp_path):
    settings.STATE_DIR = tmp_path
    return tmp_path


def _config(checkpoint: str) -> dict:
    return {"init_checkpoint": checkpoint, "steps": 2, "tasks": 2, "group_size": 2, "groups_per_step": 1,
            "rollout_workers": 2, "max_turns": 1, "max_tokens_per_turn": 8, "ray_num_cpus": 1}


def _ingest_one_step(experiment: Experiment) -> str:
    """The driver's files for one checkpointed step with one traced group; returns the group id."""
    from training.rollout.driver import METRICS_FILE, ROLLOUTS_FILE, trace_path

    run_dir = Path(experiment.run_dir)
    (run_dir / "checkpoints" / "step-00000001").mkdir(parents=True)
    rows = [{"step": 1, "abandoned": False, "rollout_id": f"group-000000/s{i}", "group_id": "group-000000",
             "task_id": "toy-7", "sample_index": i, "valid": True, "reward": float(i), "passed": bool(i),
             "status": "succeeded", "advantage": i - 0.5, "completion_tokens": 10, "turns": 1, "policy_version": 0,
             "staleness": 0, "tools_used": {}, "tool_calls": 0} for i in range(2)]
    (run_dir / ROLLOUTS_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run_dir / METRICS_FILE).write_text(json.dumps({"step": 1, "pass_rate": 0.5, "mean_reward": 0.5}) + "\n")
    for row in rows:
        path = trace_path(run_dir, row["rollout_id"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"status": "succeeded", "prompt": "fix toy-7", "final_message": "done",
                                    "messages": [], "turns": 1, "events": []}))
    assert services.experiment_ingest(experiment=experiment) == 1
    return "group-000000"


@pytest.fixture
def shared(owner, team, api_client_for, policy_checkpoint, state_dir, django_capture_on_commit_callbacks):
    """An experiment the owner launched through the API, shared with `team`, with one ingested step."""
    with django_capture_on_commit_callbacks(execute=False):
        response = api_client_for(owner).post(
            "/api/experiments/", {"name": "shared-run", "config": _config(policy_checkpoint), "team": team.name},
            format="json")
    assert response.status_code == 201, response.content
    assert response.json()["team"] == team.name and response.json()["owner"] == owner.username
    experiment = Experiment.objects.get(pk=response.json()["id"])
    group_id = _ingest_one_step(experiment)
    checkpoint = ExperimentCheckpoint.objects.get(experiment=experiment, step=1)  # ingested with the step
    return experiment, group_id, checkpoint


@pytest.fixture
def private(owner, policy_checkpoint, state_dir, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False):
        return services.experiment_create(owner=owner, name="private-run", config=_config(policy_checkpoint))


def _pages(experiment: Experiment, group_id: str) -> list[str]:
    return [reverse("experiments:experiment-detail", args=[experiment.pk]),
            reverse("experiments:experiment-clone", args=[experiment.pk]),
            reverse("experiments:experiment-group", args=[experiment.pk, group_id])]


@pytest.mark.django_db
def test_pages_teammates_read_outsiders_see_nothing(client, shared, private, owner, teammate, outsider):
    experiment, group_id, _ = shared
    for user, expected in ((owner, 200), (teammate, 200), (outsider, 404)):
        client.force_login(user)
        for url in _pages(experiment, group_id):
            assert client.get(url).status_code == expected, (user.username, url)
        listing = client.get(reverse("experiments:experiment-list")).content.decode()
        assert ("shared-run" in listing) == (user != outsider), user.username
        assert ("private-run" in listing) == (user == owner), user.username
        assert client.get(reverse("experiments:experiment-detail", args=[private.pk])).status_code == (
            200 if user == owner else 404)
    client.force_login(teammate)
    detail = client.get(reverse("experiments:experiment-detail", args=[experiment.pk])).content.decode()
    assert "shared with team ml-infra" in detail and "by owner" in detail
    assert f'action="/experiments/{experiment.pk}/pause/"' not in detail  # no controls for a teammate
    assert "Evaluate</button>" not in detail
    client.force_login(owner)
    detail = client.get(reverse("experiments:experiment-detail", args=[experiment.pk])).content.decode()
    assert f'action="/experiments/{experiment.pk}/pause/"' in detail and "Evaluate</button>" in detail


@pytest.mark.django_db
def test_only_the_owner_acts_on_the_pages(client, shared, owner, teammate, outsider,
                                          django_capture_on_commit_callbacks):
    experiment, _, checkpoint = shared
    evaluate = reverse("experiments:checkpoint-evaluate", args=[experiment.pk, checkpoint.pk])
    for user in (teammate, outsider):
        client.force_login(user)
        for action in ("pause", "resume", "cancel"):
            url = reverse(f"experiments:experiment-{action}", args=[experiment.pk])
            assert client.post(url).status_code == 404, (user.username, action)
        assert client.post(evaluate, {"suite": "toy-heldout-2", "attempts": 1}).status_code == 404
    experiment.refresh_from_db()
    assert experiment.status == "queued" and not experiment.pause_requested and not experiment.cancel_requested
    client.force_login(owner)
    with django_capture_on_commit_callbacks(execute=False):
        assert client.post(reverse("experiments:experiment-pause", args=[experiment.pk])).status_code == 302
        assert client.post(evaluate, {"suite": "toy-heldout-2", "attempts": 1}).status_code == 302
    experiment.refresh_from_db()
    assert experiment.pause_requested
    from webapp.experiments.models import BenchmarkRun

    run = BenchmarkRun.objects.get()
    assert run.owner == owner and run.team == experiment.team  # the evaluation is shared like its experiment


@pytest.mark.django_db
def test_a_teammate_clones_into_an_experiment_of_their_own(client, shared, teammate, outsider, team, policy_checkpoint,
                                                           django_capture_on_commit_callbacks):
    experiment, _, _ = shared
    url = reverse("experiments:experiment-clone", args=[experiment.pk])
    client.force_login(outsider)
    assert client.post(url, {"name": "stolen", **_config(policy_checkpoint)}).status_code == 404
    client.force_login(teammate)
    page = client.get(url).content.decode()
    assert f'<option value="{team.pk}" selected>' in page  # the clone is offered to the same team
    with django_capture_on_commit_callbacks(execute=False):
        response = client.post(url, {"name": "mine", **_config(policy_checkpoint), "share_with_team": ""})
    assert response.status_code == 302, response.content.decode()[-2000:]
    clone = Experiment.objects.get(name="mine")
    assert clone.owner == teammate and clone.team is None and clone.parent == experiment
    assert not Experiment.objects.filter(name="stolen").exists()


@pytest.mark.django_db
def test_the_form_shares_only_with_the_users_own_teams(client, owner, outsider, team, policy_checkpoint, state_dir,
                                                       django_capture_on_commit_callbacks):
    client.force_login(owner)
    with django_capture_on_commit_callbacks(execute=False):
        response = client.post(reverse("experiments:experiment-list"),
                               {"name": "team-run", **_config(policy_checkpoint), "share_with_team": team.pk})
    assert response.status_code == 302
    assert Experiment.objects.get(name="team-run").team == team
    client.force_login(outsider)
    response = client.post(reverse("experiments:experiment-list"),
                           {"name": "intruder", **_config(policy_checkpoint), "share_with_team": team.pk})
    assert response.status_code == 400 and 'data-error-for="share_with_team"' in response.content.decode()
    assert not Experiment.objects.filter(name="intruder").exists()


@pytest.mark.django_db
def test_api_teammates_read_only_owners_act(api_client_for, shared, private, owner, teammate, outsider, team,
                                            django_capture_on_commit_callbacks):
    experiment, _, _ = shared
    for user, sees in ((owner, {experiment.pk, private.pk}), (teammate, {experiment.pk}), (outsider, set())):
        api = api_client_for(user)
        assert {row["id"] for row in api.get("/api/experiments/").json()} == sees, user.username
        detail = api.get(f"/api/experiments/{experiment.pk}/")
        assert detail.status_code == (404 if user == outsider else 200)
        if user != outsider:
            assert detail.json()["team"] == team.name and [s["step"] for s in detail.json()["steps"]] == [1]
        if user != owner:
            for action in ("pause", "resume", "cancel"):
                assert api.post(f"/api/experiments/{experiment.pk}/{action}/").status_code == 404, user.username
    experiment.refresh_from_db()
    assert not experiment.pause_requested and not experiment.cancel_requested
    assert api_client_for(owner).post(f"/api/experiments/{experiment.pk}/cancel/").json()["status"] == "cancelled"
    stranger = api_client_for(outsider).post("/api/experiments/", {"name": "x", "config": {}, "team": team.name},
                                             format="json")
    assert stranger.status_code == 400 and "not a member" in stranger.json()["team"][0]


@pytest.mark.django_db
def test_the_rollout_traces_are_shared_with_the_experiment(client, shared, owner, teammate, outsider):
    experiment, _, _ = shared
    traces = [rollout.trace for rollout in ExperimentRollout.objects.filter(experiment=experiment)]
    assert len(traces) == 2 and all(trace.team == experiment.team for trace in traces)
    for user, expected in ((owner, 200), (teammate, 200), (outsider, 404)):
        client.force_login(user)
        assert client.get(reverse("agents:task-detail", args=[traces[0].pk])).status_code == expected


@pytest.fixture
def live_layer(settings):
    settings.CHANNEL_LAYERS = {**settings.CHANNEL_LAYERS,
                               LIVE_CHANNEL_LAYER: {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    return get_channel_layer(LIVE_CHANNEL_LAYER)


async def _connect(experiment_id: int, user):
    viewer = WebsocketCommunicator(ExperimentConsumer.as_asgi(), f"/ws/experiments/{experiment_id}/")
    viewer.scope["user"] = user
    viewer.scope["url_route"] = {"kwargs": {"experiment_id": experiment_id}}
    return viewer, await viewer.connect()


@pytest.mark.django_db(transaction=True)
async def test_websocket_teammates_watch_outsiders_are_refused(owner, teammate, outsider, team, live_layer):
    from channels.db import database_sync_to_async
    from django.contrib.auth.models import AnonymousUser

    from webapp.experiments.models import ExperimentStep

    @database_sync_to_async
    def create() -> Experiment:
        # Stored directly: through the service, a committed launch would enqueue a real monitor task.
        experiment = Experiment.objects.create(owner=owner, team=team, name="watched", config={"steps": 2})
        ExperimentStep.objects.create(experiment=experiment, step=1, metrics={"step": 1, "pass_rate": 0.5})
        return experiment

    experiment = await create()
    for user in (owner, teammate):
        viewer, (connected, _) = await _connect(experiment.pk, user)
        assert connected, user.username
        snapshot = json.loads(await viewer.receive_from(timeout=3))
        assert snapshot["kind"] == "snapshot" and [step["step"] for step in snapshot["steps"]] == [1]
        await viewer.disconnect()
    for user, code in ((outsider, 4404), (AnonymousUser(), 4401)):
        viewer, (connected, close_code) = await _connect(experiment.pk, user)
        assert not connected and close_code == code
    from asgiref.sync import sync_to_async
    from django.db import connections

    await sync_to_async(connections.close_all)()  # the sync thread's connection, or the test database stays in use
