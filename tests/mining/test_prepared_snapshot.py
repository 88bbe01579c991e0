"""A repository's prepared snapshot: its setup runs once (network on for that phase only), product tasks on
the repository start from that snapshot, an edited recipe invalidates it, and nothing after the setup phase
(baseline, candidate runs, the agent) has network. Real local sandboxes, real database; the agent is the
scripted policy with shell calls a hostile model could make."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from training.agent.scripted import ScriptedExpertPolicy, ScriptedTurn

pytestmark = pytest.mark.django_db

# Setup writes a token (a second setup run would write another) and what the network looked like.
SETUP = ("mkdir -p .flowstate && python3 -c 'import secrets; print(secrets.token_hex(8))' > .flowstate/marker"
         " && cat /proc/net/dev > .flowstate/setup-net.txt")
PROBE = ("cat .flowstate/marker; cat /proc/net/dev; python3 -c \"import socket\n"
         "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=3)\n    print('EGRESS' + '-OPEN')\n"
         "except OSError as error:\n    print('egress refused:', error)\"")
# The repository's own test fails if its run has network: an adversarial suite that would notice egress.
NETWORK_TEST = '''import socket
import unittest


class NoNetwork(unittest.TestCase):
    def test_only_loopback(self):
        with open("/proc/net/dev") as handle:
            interfaces = [line.split(":")[0].strip() for line in handle.read().splitlines()[2:]]
        self.assertEqual(interfaces, ["lo"])

    def test_no_egress(self):
        with self.assertRaises(OSError):
            socket.create_connection(("1.1.1.1", 53), timeout=3)
'''


def _snapshot_dirs() -> set[str]:
    from sandboxes import get_backend

    return {p.name for p in (get_backend("local").root / "snapshots").glob("snap-*")}


def _tool_outputs(task) -> str:
    return "\n".join(str(event.payload) for event in task.events.filter(kind="tool_result").order_by("seq"))


def test_product_tasks_start_from_the_prepared_snapshot_and_only_setup_has_network(
        owner, small_repository, settings, monkeypatch):
    from webapp.agents import services
    from webapp.agents.models import AgentTask, Repository
    from webapp.mining.services import (
        prepared_snapshot_get,
        recipe_edited_parse,
        repository_setup_request,
        repository_setup_run,
    )

    network = shutil.which("slirp4netns") is not None  # the local backend's egress for the setup phase
    settings.REPO_SETUP_NETWORK = network
    settings.SANDBOX_BACKEND = settings.AGENT_SANDBOX_BACKEND = "local"
    (small_repository / "tests" / "test_network.py").write_text(NETWORK_TEST)
    repository = Repository.objects.create(owner=owner, name="calc", kind="path", location=str(small_repository))
    edited = recipe_edited_parse(setup_commands=SETUP, runner="unittest",
                                 test_command="python3 -m unittest discover -v -s tests -t .")
    repository_setup_request(repository=repository, edited_recipe=edited, enqueue=False)
    recipe = repository_setup_run(repository=repository)
    # The suite's network tests pass in the baseline: the test run had no network.
    assert recipe.status == "ready", (recipe.failure, recipe.log)
    assert {"tests.test_network.NoNetwork.test_only_loopback", "tests.test_network.NoNetwork.test_no_egress"} <= set(
        recipe.recipe["baseline"]["passed"])
    kept = Path(recipe.snapshot["location"])
    marker = (kept / ".flowstate" / "marker").read_text().strip()
    setup_interfaces = (kept / ".flowstate" / "setup-net.txt").read_text()
    if network:  # the setup phase did have network: the checks above are not vacuous
        assert recipe.recipe["network"] and "tap0" in setup_interfaces

    monkeypatch.setattr(services, "_policy_for", lambda task: ScriptedExpertPolicy(
        turns=[ScriptedTurn("probe", (("run_terminal", {"command": PROBE}),))], final_message="done"))
    before = _snapshot_dirs()
    task = services.task_create(owner=owner, prompt="look around", backend="scripted", repository=repository,
                                enqueue=False)
    services.task_run(task_id=task.pk)
    task = AgentTask.objects.get(pk=task.pk)
    outputs = _tool_outputs(task)
    # Same snapshot, no second setup run (same token, no new snapshot), and the agent has no network.
    assert task.snapshot_id == recipe.snapshot["id"] and _snapshot_dirs() == before and kept.is_dir()
    assert marker in outputs and "egress refused" in outputs and "EGRESS-OPEN" not in outputs
    assert "tap0" not in outputs and " lo:" in outputs
    # Verification ran the recipe's tests (network tests included) without repeating the setup.
    assert task.outcome == "tests_pass", (task.test_summary, task.test_output[-2000:])

    # An edited recipe invalidates the kept snapshot at once, and its setup replaces it.
    edited = recipe_edited_parse(setup_commands=SETUP + " && echo edited > .flowstate/edited", runner="unittest",
                                 test_command="python3 -m unittest discover -v -s tests -t .")
    repository_setup_request(repository=repository, edited_recipe=edited, enqueue=False)
    from sandboxes import get_backend

    assert prepared_snapshot_get(repository_id=repository.pk, backend=get_backend("local")) is None
    recipe = repository_setup_run(repository=repository)
    assert recipe.status == "ready" and recipe.snapshot["id"] != task.snapshot_id
    assert not kept.exists()  # the old one is deleted (no sandbox used it any more)
    renewed = Path(recipe.snapshot["location"])
    assert (renewed / ".flowstate" / "edited").is_file()
    assert (renewed / ".flowstate" / "marker").read_text().strip() != marker
    second = services.task_create(owner=owner, prompt="again", backend="scripted", repository=repository,
                                  enqueue=False)
    services.task_run(task_id=second.pk)
    second = AgentTask.objects.get(pk=second.pk)
    assert second.snapshot_id == recipe.snapshot["id"] and renewed.is_dir()


def test_a_stored_snapshot_outside_the_backend_store_is_not_used(owner, small_repository, settings, tmp_path):
    """The kept snapshot's location comes from the database; a row pointing anywhere else (or at a snapshot
    that is gone) is ignored and the task builds its own."""
    from sandboxes import get_backend
    from webapp.agents.models import Repository
    from webapp.experiments.models import RepositoryRecipe
    from webapp.mining.services import prepared_snapshot_get, recipe_fingerprint

    backend = get_backend("local")
    repository = Repository.objects.create(owner=owner, name="calc", kind="path", location=str(small_repository))
    recipe = {"setup_commands": [], "test_command": "python3 -m unittest", "runner": "unittest", "network": False}
    stored = {"id": "snap-0123456789abcdef", "backend": "local", "location": str(tmp_path), "image": None,
              "source": ["path", str(small_repository), None], "setup_commands": [], "created_at": 0.0,
              "recipe": recipe_fingerprint(recipe)}
    RepositoryRecipe.objects.create(repository=repository, status="ready", recipe=recipe, snapshot=stored)
    assert prepared_snapshot_get(repository_id=repository.pk, backend=backend) is None
    gone = {**stored, "location": str(backend.root / "snapshots" / stored["id"] / "tree")}
    RepositoryRecipe.objects.filter(repository=repository).update(snapshot=gone)
    assert prepared_snapshot_get(repository_id=repository.pk, backend=backend) is None
    (backend.root / "snapshots" / stored["id"] / "tree").mkdir(parents=True)
    try:
        assert prepared_snapshot_get(repository_id=repository.pk, backend=backend).id == stored["id"]
        RepositoryRecipe.objects.filter(repository=repository).update(snapshot={**gone, "id": "../../etc"})
        assert prepared_snapshot_get(repository_id=repository.pk, backend=backend) is None
    finally:
        shutil.rmtree(backend.root / "snapshots" / stored["id"])
