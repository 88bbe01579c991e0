"""The project's OpenAI-compatible endpoint serving a real (random-weights) checkpoint, driven by the
official ``openai`` client, and a cloud task whose built-in policy goes through it end to end."""

from __future__ import annotations

import os
import time

import openai
import pytest
from django.test import Client

from webapp.accounts.services import api_token_get_or_create

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    from training.checkpoint import create_random_checkpoint

    return create_random_checkpoint(tmp_path_factory.mktemp("builtin-ckpt"), size="tiny", seed=1, max_seq_len=4096)


@pytest.fixture
def builtin_model(checkpoint_dir, settings, monkeypatch):
    """Configure the checkpoint here and in child processes started after this fixture."""
    monkeypatch.setenv("FLOWSTATE_MODEL_CHECKPOINT", str(checkpoint_dir))
    settings.MODEL_CHECKPOINT = str(checkpoint_dir)
    return checkpoint_dir


@pytest.mark.django_db(transaction=True)
def test_official_openai_client_against_the_endpoint(builtin_model, owner, asgi_server):
    client = openai.OpenAI(base_url=f"http://{asgi_server}/v1", api_key=api_token_get_or_create(user=owner), max_retries=0)
    assert [m.id for m in client.models.list().data] == ["flowstate"]
    messages = [{"role": "user", "content": "Read README.md please."}]
    response = client.chat.completions.create(model="flowstate", messages=messages, tools=TOOLS, max_tokens=12,
                                              temperature=0, seed=3)
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert response.usage.completion_tokens >= 1
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    extension = response.model_extra["flowstate"]
    assert len(extension["token_ids"]) == response.usage.completion_tokens == len(extension["logprobs"])
    assert len(extension["prompt_token_ids"]) == response.usage.prompt_tokens
    assert extension["sampling_masks"] is None  # no tool result yet: nothing to copy, nothing masked

    chunks = list(client.chat.completions.create(model="flowstate", messages=messages, tools=TOOLS, max_tokens=12,
                                                 temperature=0, seed=3, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (choice.message.content or "")  # greedy decoding: same text either way
    assert chunks[-1].usage.completion_tokens == response.usage.completion_tokens
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


@pytest.mark.django_db(transaction=True)
def test_endpoint_errors_are_clear(builtin_model, owner, asgi_server):
    base = f"http://{asgi_server}/v1"
    with pytest.raises(openai.AuthenticationError, match="Bearer"):
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=base, api_key=api_token_get_or_create(user=owner), max_retries=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
        client.chat.completions.create(model="flowstate", messages=[])
    with pytest.raises(openai.BadRequestError, match="temperature must be"):
        client.chat.completions.create(model="flowstate", messages=[{"role": "user", "content": "hi"}], temperature=7)
    with pytest.raises(openai.BadRequestError, match="fills the model's context"):
        client.chat.completions.create(model="flowstate", messages=[{"role": "user", "content": "word " * 6000}])


@pytest.mark.django_db
def test_unconfigured_model_answers_503(owner, settings):
    settings.MODEL_CHECKPOINT = None
    response = Client().post("/v1/chat/completions", data={"model": "flowstate", "messages": [{"role": "user", "content": "x"}]},
                             content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {api_token_get_or_create(user=owner)}")
    assert response.status_code == 503
    assert "FLOWSTATE_MODEL_CHECKPOINT" in response.json()["error"]["message"]


@pytest.mark.django_db(transaction=True)
def test_builtin_model_task_end_to_end(builtin_model, owner, demo_repository, asgi_server, celery_worker_process,
                                       api_client_for, settings):
    from webapp.agents.models import AgentTask

    assert os.environ["FLOWSTATE_MODEL_CHECKPOINT"] == str(builtin_model)
    settings.AGENT_BUILTIN_BASE_URL = f"http://{asgi_server}/v1"
    response = api_client_for(owner).post("/api/tasks/", {
        "prompt": "Fix the failing median test", "backend": "builtin", "repository_id": demo_repository.pk,
        "limits": {"max_turns": 2, "max_tokens": 64, "max_tokens_per_turn": 16, "context_tokens": 4096},
        "policy_options": {"seed": 5},
    }, format="json")
    assert response.status_code == 201, response.json()
    task_id = response.json()["id"]
    deadline = time.monotonic() + 240
    while (task := AgentTask.objects.get(pk=task_id)).status not in AgentTask.FINISHED:
        assert time.monotonic() < deadline, f"task still {task.status}"
        time.sleep(0.5)
    # Random weights rarely fix anything; the assertions are on the flow through the real endpoint.
    kinds = list(task.events.values_list("kind", flat=True))
    if kinds[-1] == "tests":  # the verification runs after the agent's final event (webapp.agents.verify)
        kinds.pop()
    assert kinds[0] == "start" and kinds[-1] == "final" and "model_output" in kinds
    output = task.events.filter(kind="model_output").first().payload
    assert output["prompt_tokens"] > 1000 and not output["tokens_estimated"]  # counted by the real tokenizer
    assert task.prompt_tokens >= output["prompt_tokens"] and task.completion_tokens >= 1
    assert task.status in ("succeeded", "failed") and task.status_reason
    assert "policy error" not in task.status_reason, task.status_reason
    assert task.model_name == "flowstate" and task.backend == "builtin"


@pytest.mark.django_db(transaction=True)
def test_openai_client_n_choices_logprobs_and_streaming(builtin_model, owner, asgi_server):
    """n seeded samples with OpenAI-shaped logprobs equal to a forward pass of the checkpoint, streamed alike."""
    import torch

    from training.checkpoint import load_checkpoint

    client = openai.OpenAI(base_url=f"http://{asgi_server}/v1", api_key=api_token_get_or_create(user=owner), max_retries=0)
    request = {"model": "flowstate", "messages": [{"role": "user", "content": "Read README.md please."}],
               "max_tokens": 8, "temperature": 1.0, "seed": 9, "logprobs": True, "top_logprobs": 3}
    response = client.chat.completions.create(n=3, **request)
    assert [c.index for c in response.choices] == [0, 1, 2]
    model, _, _ = load_checkpoint(builtin_model)
    samples = []
    for choice in response.choices:
        extension = choice.model_extra["flowstate"]
        entries = choice.logprobs.content
        assert len(entries) == len(extension["token_ids"]) and all(len(e.top_logprobs) == 3 for e in entries)
        ids = extension["prompt_token_ids"] + extension["token_ids"]
        with torch.no_grad():
            expected = model(torch.tensor([ids[:-1]])).logits[0].log_softmax(-1)[len(extension["prompt_token_ids"]) - 1:]
        for step, (entry, token) in enumerate(zip(entries, extension["token_ids"], strict=True)):
            assert abs(entry.logprob - expected[step, token].item()) < 1e-4
            top = expected[step].topk(3).values.tolist()
            assert all(abs(a.logprob - b) < 1e-4 for a, b in zip(entry.top_logprobs, top, strict=True))
        samples.append(tuple(extension["token_ids"]))
    assert len(set(samples)) == 3
    assert response.usage.completion_tokens == sum(len(s) for s in samples)

    chunks = list(client.chat.completions.create(n=2, stream=True, **request))
    for index in (0, 1):
        streamed = [e for c in chunks for ch in c.choices if ch.index == index and ch.logprobs for e in ch.logprobs.content]
        whole = response.choices[index].logprobs.content
        # the same seeded samples; logprobs equal up to rounding (another batch, a prefix-cache hit)
        assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in whole]
        assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-4)
        text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices if ch.index == index)
        assert text == (response.choices[index].message.content or "")
    with pytest.raises(openai.BadRequestError, match="n must be an integer between 1 and 16"):
        client.chat.completions.create(model="flowstate", messages=request["messages"], n=17)
    with pytest.raises(openai.BadRequestError, match="top_logprobs must be an integer between 0 and 20"):
        client.chat.completions.create(model="flowstate", messages=request["messages"], logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="top_logprobs requires logprobs"):
        client.chat.completions.create(model="flowstate", messages=request["messages"], top_logprobs=2)


@pytest.mark.django_db
@pytest.mark.parametrize("extra, message", [
    ({"n": 0}, "n must be an integer between 1 and 16"),
    ({"n": True}, "n must be an integer between 1 and 16"),
    ({"n": 2.0}, "n must be an integer between 1 and 16"),
    ({"n": 10**30}, "n must be an integer between 1 and 16"),
    ({"logprobs": "yes"}, "logprobs must be true or false"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs must be an integer between 0 and 20"),
    ({"logprobs": True, "top_logprobs": "5"}, "top_logprobs must be an integer between 0 and 20"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs requires logprobs: true"),
], ids=["n-zero", "n-bool", "n-float", "n-huge", "logprobs-string", "top-negative", "top-string", "top-without-logprobs"])
def test_hostile_n_and_logprobs_are_refused_before_any_model_loads(owner, settings, extra, message):
    settings.MODEL_CHECKPOINT = None  # validation must answer before the (absent) model is looked at
    body = {"model": "flowstate", "messages": [{"role": "user", "content": "x"}], **extra}
    response = Client().post("/v1/chat/completions", data=body, content_type="application/json",
                             HTTP_AUTHORIZATION=f"Bearer {api_token_get_or_create(user=owner)}")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert message in error["message"]
    assert error["param"] == ("top_logprobs" if "top_logprobs" in extra else next(iter(extra)))
