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


@pytest.mark.django_db(transaction=True)
def test_openai_client_n_logprobs_streaming_on_a_registered_model(source_dir, settings, tmp_path, owner, asgi_server):
    """A registered Qwen3-MoE through the live server: n samples whose logprobs/top_logprobs equal
    transformers' own forward of the checkpoint, and the streamed choices carry the same entries."""
    import openai
    import torch
    import transformers

    settings.MODELS_ROOT = tmp_path / "models"
    import_model(source=source_dir, name="tiny-live", verify_weights=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    client = openai.OpenAI(base_url=f"http://{asgi_server}/v1", api_key=api_token_get_or_create(user=owner),
                           max_retries=0)
    request = {"model": "tiny-live", "messages": [{"role": "user", "content": "read a.py"}], "tools": TOOLS,
               "max_tokens": 6, "temperature": 0.8, "seed": 21, "logprobs": True, "top_logprobs": 4}
    response = client.chat.completions.create(n=3, **request)
    samples = []
    for choice in response.choices:
        extension = choice.model_extra["flowstate"]
        prompt, tokens = extension["prompt_token_ids"], extension["token_ids"]
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
        expected = (logits / 0.8).log_softmax(-1)
        entries = choice.logprobs.content
        assert [e.logprob for e in entries] == pytest.approx([expected[i, t].item() for i, t in enumerate(tokens)], abs=1e-4)
        for step, entry in enumerate(entries):
            assert [a.logprob for a in entry.top_logprobs] == pytest.approx(expected[step].topk(4).values.tolist(), abs=1e-4)
            assert all(bytes(a.bytes).decode("utf-8", "replace") == a.token for a in entry.top_logprobs)
        samples.append(tuple(tokens))
    assert len(set(samples)) == 3 and [c.index for c in response.choices] == [0, 1, 2]
    chunks = list(client.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **request))
    for index in (0, 1):
        streamed = [e for c in chunks for ch in c.choices if ch.index == index and ch.logprobs for e in ch.logprobs.content]
        whole = response.choices[index].logprobs.content
        # the same seeded samples; logprobs equal up to rounding (another batch, a prefix-cache hit)
        assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in whole]
        assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-4)
    assert chunks[-1].usage.completion_tokens == len(samples[0]) + len(samples[1])
