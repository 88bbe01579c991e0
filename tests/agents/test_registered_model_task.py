"""A cloud task on an imported (registered) model, end to end: the API submits it with ``model_name``, a real
Celery worker runs the agent loop in a real sandbox, the policy calls this server's /v1 endpoint, which
renders the conversation with the model's own chat template and parses its Hermes tool calls.

The model is tests/registry/tool_calling_model.py: a tiny Qwen3-MoE built with transformers whose weights
are set by hand (a bigram chain) so that it deterministically answers every turn with a read_file tool
call; a random tiny model would almost never emit a well-formed one. Nothing else is scripted: the call
is sampled by the engine from the model's logits, parsed by the family's parser and run in the sandbox.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.registry.tool_calling_model import save_tool_calling_model
from webapp.registry.services import import_model

pytest.importorskip("transformers")
CONTEXT = 16384
"""The byte-level tiny tokenizer turns the agent's system prompt and tool schemas into ~9k tokens."""


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tool-model") / "tiny-tools"
    save_tool_calling_model(directory)
    return directory


@pytest.fixture
def serving_context(monkeypatch, settings):
    """Serve registered models with a long context, here and in the server started after this fixture."""
    monkeypatch.setenv("FLOWSTATE_MODELS_SERVING_CONTEXT", str(CONTEXT))
    settings.MODELS_SERVING_CONTEXT = CONTEXT


@pytest.mark.django_db(transaction=True)
def test_cloud_task_runs_the_agent_loop_on_an_imported_model(serving_context, tool_model_dir, owner, demo_repository,
                                                             asgi_server, celery_worker_process, api_client_for,
                                                             settings, tmp_path):
    from webapp.agents.models import AgentTask

    settings.MODELS_ROOT = tmp_path / "models"
    import_model(source=tool_model_dir, name="tiny-tools", owner=owner, verify_weights=False)
    settings.AGENT_BUILTIN_BASE_URL = f"http://{asgi_server}/v1"
    response = api_client_for(owner).post("/api/tasks/", {
        "prompt": "Fix the failing median test", "backend": "builtin", "model_name": "tiny-tools",
        "repository_id": demo_repository.pk,
        "limits": {"max_turns": 3, "max_tokens": 256, "max_tokens_per_turn": 16, "context_tokens": CONTEXT},
        "policy_options": {"seed": 5},
    }, format="json")
    assert response.status_code == 201, response.json()
    task_id = response.json()["id"]
    deadline = time.monotonic() + 420
    while (task := AgentTask.objects.get(pk=task_id)).status not in AgentTask.FINISHED:
        assert time.monotonic() < deadline, f"task still {task.status}"
        time.sleep(0.5)

    # The model cannot fix anything (it only reads README.md): the task fails honestly after its turns.
    assert task.status in ("succeeded", "failed") and task.status_reason
    assert "policy error" not in task.status_reason, task.status_reason
    assert task.model_name == "tiny-tools" and task.backend == "builtin" and task.turns >= 2
    events = list(task.events.order_by("seq").values_list("kind", "payload"))
    start = next(payload for kind, payload in events if kind == "start")
    assert "tiny-tools" in start["policy"]
    outputs = [payload for kind, payload in events if kind == "model_output"]
    assert len(outputs) >= 2 and all(o["tool_calls"] == 1 and o["finish_reason"] == "tool_calls" for o in outputs)
    # counted by the model's own tokenizer through the template; the conversation grows turn by turn
    assert not outputs[0]["tokens_estimated"] and outputs[1]["prompt_tokens"] > outputs[0]["prompt_tokens"] > 1000
    calls = [payload for kind, payload in events if kind == "tool_call"]
    assert len(calls) >= 2 and {c["name"] for c in calls} == {"read_file"}
    arguments = calls[0]["arguments"]
    assert (json.loads(arguments) if isinstance(arguments, str) else arguments) == {"path": "README.md"}
    results = [payload for kind, payload in events if kind == "tool_result"]
    assert results and results[0]["name"] == "read_file"
