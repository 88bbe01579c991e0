"""/v1/chat/completions and /v1/models serve registered models by name, to those who may see them."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.training.hf.hf_models import save_hf_directory
from webapp.accounts.services import api_token_get_or_create
from webapp.registry.services import import_model

pytest.importorskip("transformers")
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("src") / "tiny-qwen3-moe"
    save_hf_directory("qwen3_moe", directory)
    return directory


@pytest.fixture
def registered(db, source_dir, settings, tmp_path, owner, team):
    settings.MODELS_ROOT = tmp_path / "models"
    return {
        "public": import_model(source=source_dir, name="tiny-public", verify_weights=False),
        "private": import_model(source=source_dir, name="tiny-private", owner=owner, verify_weights=False),
    }


def _post(client, user, body):
    return client.post("/v1/chat/completions", json.dumps(body), content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {api_token_get_or_create(user=user)}")


def test_chat_completion_by_registered_name_plain_and_streamed(client, registered, owner):
    body = {"model": "tiny-public", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "max_tokens": 5, "temperature": 0}
    response = _post(client, owner, body)
    assert response.status_code == 200, response.content
    data = response.json()
    assert data["model"] == "tiny-public" and data["usage"]["completion_tokens"] >= 1
    assert len(data["flowstate"]["logprobs"]) == data["usage"]["completion_tokens"]
    streamed = _post(client, owner, {**body, "stream": True})
    async def collect() -> bytes:
        return b"".join([part async for part in streamed.streaming_content])

    text = asyncio.run(collect()).decode()
    assert '"model": "tiny-public"' in text and text.rstrip().endswith("data: [DONE]")


def test_private_registered_model_is_hidden_from_outsiders(client, registered, owner, teammate, outsider):
    body = {"model": "tiny-private", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert _post(client, outsider, body).status_code == 404
    assert _post(client, teammate, body).status_code == 404  # no team: owner only
    listed = {user.username: {m["id"] for m in client.get(
        "/v1/models", HTTP_AUTHORIZATION=f"Bearer {api_token_get_or_create(user=user)}").json()["data"]}
        for user in (owner, outsider)}
    assert listed["owner"] >= {"flowstate", "tiny-public", "tiny-private"}
    assert "tiny-private" not in listed["outsider"] and "tiny-public" in listed["outsider"]
    assert client.get("/v1/models").status_code == 401


def test_hf_chat_model_parses_the_tool_calls_it_generates(source_dir):
    from training.engine import GenerationResult
    from training.hf.serving import HFChatModel

    chat_model = HFChatModel(source_dir, name="tiny")
    try:
        reply = {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "read_file", "arguments": json.dumps({"path": "a.py"})}}]}
        messages = [{"role": "user", "content": "read a.py"}]
        text = chat_model.chat.render_assistant(messages, reply, tools=TOOLS)
        ids = chat_model.hf_tokenizer.encode(text, add_special_tokens=False).ids
        prompt = chat_model._prompt_ids(messages, TOOLS)
        result = GenerationResult(0, prompt, ids, [0.0] * len(ids), "stop", None)
        completion = chat_model._completion(result)
        assert completion.finish_reason == "tool_calls" and completion.parse_error is None
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in completion.tool_calls] == [
            ("read_file", {"path": "a.py"})]
        assert chat_model.stop_ids and ids[-1] in chat_model.stop_ids
    finally:
        chat_model.close()


def test_builtin_task_runs_a_registered_model_the_owner_may_use(registered, owner, outsider, settings):
    from django.core.exceptions import ValidationError

    from webapp.agents.services import task_create

    settings.MODEL_CHECKPOINT = None
    arguments = {"prompt": "fix it", "backend": "builtin", "git_url": "https://example.com/x.git",
                 "builtin_base_url": "http://testserver/v1", "enqueue": False}
    task = task_create(owner=owner, model_name="tiny-private", **arguments)
    assert task.model_name == "tiny-private" and task.backend == "builtin"
    with pytest.raises(ValidationError, match="not a registered model you may use"):
        task_create(owner=outsider, model_name="tiny-private", **arguments)
    with pytest.raises(ValidationError, match="not configured"):
        task_create(owner=outsider, **arguments)


def test_task_form_offers_visible_registered_models(client, registered, outsider):
    client.force_login(outsider)
    page = client.get("/tasks/").content.decode()
    assert 'value="tiny-public"' in page and "tiny-private" not in page
