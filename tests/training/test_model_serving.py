"""Checkpoints and ChatModel serving: load, complete, stream, concurrency, tool-call parsing end to end."""

from __future__ import annotations

import json
import os
import threading

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from training.chat_format import render_assistant_completion, render_messages
from training.checkpoint import (
    CheckpointError,
    average_checkpoints,
    create_random_checkpoint,
    interpolate_checkpoints,
    load_checkpoint,
    read_checkpoint_config,
    save_checkpoint,
)
from training.checkpoint import main as checkpoint_main
from training.engine import EngineConfig
from training.model import ModelConfig, MoETransformer
from training.serving import ChatCompletion, ChatModel, ServingError
from training.tokenizer import default_tokenizer

torch.set_num_threads(1)

MESSAGES = [{"role": "system", "content": "You fix code."}, {"role": "user", "content": "Run the tests."}]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "run_terminal", "parameters": {"type": "object", "properties": {"command": {}}}},
    }
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return create_random_checkpoint(tmp_path_factory.mktemp("ckpt"), size="tiny", seed=1, max_seq_len=512)


@pytest.fixture(scope="module")
def chat_model(checkpoint):
    chat_model = ChatModel.load(checkpoint, engine_config=EngineConfig(max_batch_size=4))
    yield chat_model
    chat_model.close()


def test_checkpoint_round_trip_preserves_weights_config_tokenizer_and_meta(tmp_path):
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig.named("tiny", tie_embeddings=False, n_layers=3))
    tokenizer = default_tokenizer(2048)
    save_checkpoint(tmp_path, model, tokenizer, {"step": 7, "run": "abc"})
    loaded, loaded_tokenizer, meta = load_checkpoint(tmp_path)
    assert meta == {"step": 7, "run": "abc"} and loaded.config == model.config
    assert loaded_tokenizer.to_json() == tokenizer.to_json()
    for (name, original), (_, restored) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(original, restored), name
    input_ids = torch.randint(0, 2048, (1, 9))
    torch.testing.assert_close(loaded(input_ids).logits, model.eval()(input_ids).logits, rtol=0, atol=0)
    assert not list(tmp_path.glob("*.tmp"))


def test_random_checkpoints_are_reproducible_and_tied(tmp_path):
    first = load_checkpoint(create_random_checkpoint(tmp_path / "a", seed=3))[0]
    second = load_checkpoint(create_random_checkpoint(tmp_path / "b", seed=3))[0]
    other = load_checkpoint(create_random_checkpoint(tmp_path / "c", seed=4))[0]
    assert torch.equal(first.embed.weight, second.embed.weight)
    assert not torch.equal(first.embed.weight, other.embed.weight)
    assert first.output.weight is first.embed.weight
    assert read_checkpoint_config(tmp_path / "a")[1] == {"source": "random", "size": "tiny", "seed": 3}


def test_averaged_checkpoint_holds_the_mean_of_the_weights(tmp_path):
    sources = [create_random_checkpoint(tmp_path / name, seed=seed) for name, seed in (("a", 3), ("b", 4), ("c", 5))]
    models = [load_checkpoint(source)[0] for source in sources]
    average = average_checkpoints(sources=sources, output=tmp_path / "mean")
    averaged, tokenizer, meta = load_checkpoint(average)
    assert meta == {"source": "average", "averaged": [str(source) for source in sources]}
    for name, tensor in averaged.state_dict().items():
        expected = sum(model.state_dict()[name] for model in models) / 3
        torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-6, msg=name)
    assert averaged.output.weight is averaged.embed.weight
    with pytest.raises(CheckpointError, match="at least two"):
        average_checkpoints(sources=sources[:1], output=tmp_path / "one")
    create_random_checkpoint(tmp_path / "deeper", seed=3, n_layers=3)
    with pytest.raises(CheckpointError, match="another model config"):
        average_checkpoints(sources=[sources[0], tmp_path / "deeper"], output=tmp_path / "mixed")


def test_interpolated_checkpoint_lies_on_the_line_through_start_and_end(tmp_path):
    start_dir = create_random_checkpoint(tmp_path / "start", seed=3)
    end_dir = create_random_checkpoint(tmp_path / "end", seed=4)
    start, end = load_checkpoint(start_dir)[0], load_checkpoint(end_dir)[0]
    for alpha in (0.25, 1.5):
        mixed_dir = interpolate_checkpoints(start=start_dir, end=end_dir, alpha=alpha, output=tmp_path / f"a{alpha}")
        mixed, _, meta = load_checkpoint(mixed_dir)
        assert meta == {"source": "interpolation", "start": str(start_dir), "end": str(end_dir), "alpha": alpha}
        for name, tensor in mixed.state_dict().items():
            expected = start.state_dict()[name] + alpha * (end.state_dict()[name] - start.state_dict()[name])
            torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-6, msg=name)
        assert mixed.output.weight is mixed.embed.weight
    same = load_checkpoint(interpolate_checkpoints(start=start_dir, end=end_dir, alpha=1.0, output=tmp_path / "one"))[0]
    for name, tensor in same.state_dict().items():
        torch.testing.assert_close(tensor, end.state_dict()[name], rtol=0, atol=1e-6, msg=name)
    with pytest.raises(CheckpointError, match="alpha must be a positive number"):
        interpolate_checkpoints(start=start_dir, end=end_dir, alpha=0.0, output=tmp_path / "zero")
    create_random_checkpoint(tmp_path / "deeper", seed=3, n_layers=3)
    with pytest.raises(CheckpointError, match="another model config"):
        interpolate_checkpoints(start=start_dir, end=tmp_path / "deeper", alpha=0.5, output=tmp_path / "mixed")


def test_interpolation_command_writes_the_checkpoint_and_rejects_half_its_arguments(tmp_path, capsys):
    start_dir = create_random_checkpoint(tmp_path / "start", seed=3)
    end_dir = create_random_checkpoint(tmp_path / "end", seed=4)
    assert checkpoint_main([str(tmp_path / "out"), "--interpolate", str(start_dir), str(end_dir), "--alpha", "0.5"]) == 0
    assert read_checkpoint_config(tmp_path / "out")[1]["alpha"] == 0.5
    assert "0.5 *" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        checkpoint_main([str(tmp_path / "half"), "--alpha", "0.5"])
    assert "go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        checkpoint_main([str(tmp_path / "bad"), "--interpolate", str(start_dir), str(end_dir), "--alpha", "-1"])
    assert "alpha must be a positive number" in capsys.readouterr().err


def test_broken_checkpoints_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_checkpoint(tmp_path)
    directory = create_random_checkpoint(tmp_path / "ok")
    config = json.loads((directory / "config.json").read_text())
    config["model"]["n_layers"] = 5
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="does not match config.json"):
        load_checkpoint(directory)
    model = MoETransformer(ModelConfig.named("tiny", vocab_size=1024))
    with pytest.raises(CheckpointError, match="vocab_size >= 2048"):
        save_checkpoint(tmp_path / "small_vocab", model, default_tokenizer(2048))
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        save_checkpoint(
            tmp_path / "meta", MoETransformer(ModelConfig.named("tiny")), default_tokenizer(2048), {"x": {1}}
        )


def test_complete_returns_the_contract_fields(chat_model):
    completion = chat_model.complete(
        messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=1.0, top_p=1.0, seed=3
    )
    assert isinstance(completion, ChatCompletion)
    assert completion.prompt_token_ids == chat_model.tokenizer.encode(render_messages(MESSAGES, TOOLS))
    assert completion.prompt_tokens == len(completion.prompt_token_ids)
    assert completion.completion_tokens == len(completion.token_ids) == len(completion.logprobs) <= 12
    assert completion.routed_experts.shape[0] == completion.prompt_tokens + completion.completion_tokens - 1
    assert completion.finish_reason in {"stop", "length", "tool_calls"}
    assert json.loads(json.dumps(completion.flowstate_extension()))["token_ids"] == completion.token_ids
    again = chat_model.complete(
        messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=1.0, top_p=1.0, seed=3
    )
    assert again.token_ids == completion.token_ids


def test_concurrent_requests_match_sequential_ones(chat_model):
    def ask(seed):
        return chat_model.complete(
            messages=MESSAGES, max_tokens=10, temperature=1.0, top_p=0.95, seed=seed
        ).token_ids

    sequential = [ask(seed) for seed in range(6)]
    concurrent: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda s=s: concurrent.__setitem__(s, ask(s))) for s in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert [concurrent[s] for s in range(6)] == sequential


def test_stream_yields_content_deltas_then_the_completion(chat_model):
    items = list(chat_model.stream(messages=MESSAGES, max_tokens=15, temperature=1.0, seed=8))
    *deltas, final = items
    assert isinstance(final, ChatCompletion) and all(isinstance(d, str) and d for d in deltas)
    if not final.tool_calls and final.parse_error is None:
        assert "".join(deltas) == final.content


def test_closing_a_stream_cancels_the_request(chat_model):
    stream = chat_model.stream(messages=MESSAGES, max_tokens=400, temperature=1.0, seed=1)
    next(stream)
    stream.close()
    # the worker processes the cancel before the next request; the freed slot serves it
    completion = chat_model.complete(messages=MESSAGES, max_tokens=3, temperature=0, timeout_s=60)
    assert completion.completion_tokens <= 3
    assert chat_model.engine.num_running == 0


def test_over_long_conversations_are_rejected(chat_model):
    with pytest.raises(ValueError, match="fills the model's context of 512"):
        chat_model.complete(messages=[{"role": "user", "content": "x " * 2000}], max_tokens=5)


def test_closed_model_refuses_requests(checkpoint):
    chat_model = ChatModel.load(checkpoint)
    chat_model.close()
    with pytest.raises(ServingError, match="closed"):
        chat_model.complete(messages=MESSAGES, max_tokens=2)


def test_trained_model_emits_tool_calls_that_serving_parses(tmp_path):
    """Overfit the tiny model on one tool-calling turn; serving must stop at the block end and parse it."""
    tokenizer = default_tokenizer(2048)
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig.named("tiny", max_seq_len=512))
    target = {
        "role": "assistant",
        "content": "Running them.",
        "tool_calls": [
            {"id": "x", "function": {"name": "run_terminal", "arguments": '{"command": "pytest -q"}'}}
        ],
    }
    prompt_ids = tokenizer.encode(render_messages(MESSAGES, TOOLS))
    completion_ids = tokenizer.encode(render_assistant_completion(target))
    sequence = torch.tensor([prompt_ids + completion_ids])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(80):
        logits = model(sequence[:, :-1]).logits[0, len(prompt_ids) - 1 :]
        loss = torch.nn.functional.cross_entropy(logits, sequence[0, len(prompt_ids) :])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert loss.item() < 0.05
    save_checkpoint(tmp_path, model, tokenizer, {"name": "overfit"})
    chat_model = ChatModel.load(tmp_path)
    try:
        completion = chat_model.complete(messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=0)
    finally:
        chat_model.close()
    assert chat_model.name == "overfit"
    assert completion.finish_reason == "tool_calls" and completion.content == "Running them."
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in completion.tool_calls
    ] == [("run_terminal", {"command": "pytest -q"})]
    assert completion.token_ids[-1] == tokenizer.tool_calls_end_id  # stopped at the end of the block


def test_a_failed_generation_step_fails_its_requests_and_serving_continues(checkpoint):
    chat_model = ChatModel.load(checkpoint)
    healthy_decode = chat_model.engine._decode
    failures = []

    def decode_failing_once():
        if not failures:
            failures.append(1)
            raise RuntimeError("device lost")
        return healthy_decode()

    chat_model.engine._decode = decode_failing_once
    try:
        with pytest.raises(ServingError, match="device lost"):
            chat_model.complete(messages=MESSAGES, max_tokens=5, timeout_s=60)
        assert chat_model.engine.num_running == 0
        assert chat_model.complete(messages=MESSAGES, max_tokens=3, timeout_s=60).completion_tokens <= 3
    finally:
        chat_model.close()


def test_update_weights_between_steps_switches_the_policy(checkpoint, tmp_path):
    other_dir = create_random_checkpoint(tmp_path / "other", size="tiny", seed=2, max_seq_len=512)
    other_weights = load_checkpoint(other_dir)[0].state_dict()
    reference = ChatModel.load(other_dir)
    chat_model = ChatModel.load(checkpoint)
    try:
        expected = reference.complete(messages=MESSAGES, max_tokens=8, temperature=1.0, seed=4)
        before = chat_model.complete(messages=MESSAGES, max_tokens=8, temperature=1.0, seed=4)
        assert before.weights_version == 0
        assert before.token_ids != expected.token_ids or before.logprobs != pytest.approx(expected.logprobs)
        # an update while a long request is decoding is applied between steps; the request finishes
        stream = chat_model.stream(messages=MESSAGES, max_tokens=40, temperature=1.0, seed=0)
        next(stream)
        assert chat_model.update_weights(other_weights) == 1
        *_, in_flight = stream
        assert in_flight.weights_version == 1
        after = chat_model.complete(messages=MESSAGES, max_tokens=8, temperature=1.0, seed=4)
        assert after.weights_version == 1 and after.token_ids == expected.token_ids
        assert after.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
        assert chat_model.update_weights(other_weights, version=7) == 7
        with pytest.raises(ValueError, match="Cannot load these weights"):
            chat_model.update_weights({"embed.weight": torch.zeros(3, 3)})
    finally:
        chat_model.close()
        reference.close()


def test_command_line_creates_a_servable_checkpoint(tmp_path, capsys):
    from training.checkpoint import main

    assert main([str(tmp_path / "cli"), "--size", "tiny", "--seed", "5"]) == 0
    assert "tiny, 1.15M parameters" in capsys.readouterr().out
    model, tokenizer, meta = load_checkpoint(tmp_path / "cli")
    assert meta["seed"] == 5 and tokenizer.vocab_size == model.config.vocab_size
