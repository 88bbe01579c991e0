"""Training an imported model: checkpoints that carry its tokenizer and template, resume exactly and export
back; SFT masks from its own template; GRPO (sync rl() and the Learner) with routing replay and MXFP8 experts."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.training.hf.policy_models import save_policy_directory
from training.checkpoint import load_checkpoint, save_checkpoint
from training.hf.policy import HF_SUBDIR, HFTokenizer, export_checkpoint
from training.hf.sft import assistant_spans, tokenize_hf_trajectory
from training.train.loop import LoopConfig, OptimizerConfig
from training.train.sft import SFTConfig, sft

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("imported") / "qwen3-moe-tiny"
    save_policy_directory(directory)
    return directory


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def conversation() -> list[dict]:
    """A tool-using agent trajectory: system, task, two tool-calling turns, a final answer."""
    return [
        {"role": "system", "content": "You are Flowstate, a coding agent."},
        {"role": "user", "content": "calc.add subtracts; fix it."},
        {"role": "assistant", "content": "Let me read it.", "tool_calls": [_call("c1", "read_file", {"path": "calc.py"})]},
        {"role": "tool", "tool_call_id": "c1", "content": "def add(a, b):\n    return a - b\n"},
        {"role": "assistant", "content": "", "tool_calls": [
            _call("c2", "edit_file", {"path": "calc.py", "old_str": "a - b", "new_str": "a + b"}),
            _call("c3", "run", {"command": "python -m pytest -q"}),
        ]},
        {"role": "tool", "tool_call_id": "c2", "content": "edited calc.py"},
        {"role": "tool", "tool_call_id": "c3", "content": "1 passed"},
        {"role": "assistant", "content": "Fixed: add now adds."},
    ]


def _runs(example) -> list[list[int]]:
    runs, current = [], []
    for token, train in zip(example.token_ids, example.trainable, strict=True):
        if train:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_sft_mask_is_exactly_the_assistant_turns_of_the_models_own_rendering(policy_dir):
    from sandboxes.tools import openai_tool_schemas

    tokenizer = HFTokenizer.from_directory(policy_dir)
    tools = openai_tool_schemas()
    messages = conversation()
    example = tokenize_hf_trajectory(messages=messages, tools=tools, tokenizer=tokenizer)
    rendered = tokenizer.chat.render(messages, tools=tools, add_generation_prompt=False)
    assert tokenizer.decode(example.token_ids) == rendered
    # Independent oracle: in the Qwen/Hermes rendering, the assistant writes from after its header up to and
    # including <|im_end|>; everything else (system + tools, user, tool responses, headers) is context.
    expected = re.findall(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", rendered, flags=re.S)
    assert len(expected) == 3 and "<tool_call>" in expected[0] and expected[1].count("<tool_call>") == 2
    assert [tokenizer.decode(run) for run in _runs(example)] == expected == assistant_spans(tokenizer, messages, tools)
    # The tool calls in the trained text parse back (the family's parser) to the conversation's calls.
    content, calls = tokenizer.chat.parse(expected[1])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("edit_file", {"path": "calc.py", "old_str": "a - b", "new_str": "a + b"}),
        ("run", {"command": "python -m pytest -q"}),
    ]
    # A turn marked "train": false is context.
    messages[2]["train"] = False
    runs = [tokenizer.decode(run) for run in _runs(tokenize_hf_trajectory(messages=messages, tools=tools,
                                                                         tokenizer=tokenizer))]
    assert runs == expected[1:]


class _Stop(Exception):
    pass


def _run_sft(run_dir, policy_dir, *, steps: int, stop_after: int | None = None):
    config = SFTConfig(
        run_dir=str(run_dir), init_checkpoint=str(policy_dir), jsonl_files=(str(run_dir.parent / "data.jsonl"),),
        max_seq_len=4096,
        loop=LoopConfig(steps=steps, batch_size=2, micro_batch_size=1, checkpoint_every=1, keep_checkpoints=2,
                        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=1, weight_decay=0.0, min_lr_ratio=0.1)),
    )

    def on_step(metrics):
        if stop_after is not None and metrics["step"] > stop_after:
            raise _Stop  # the process dies after step stop_after's checkpoint, before the next one's
    return sft(config, on_step=on_step)


def test_sft_on_an_imported_model_learns_resumes_exactly_and_exports(policy_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    short = conversation()[:4] + [{"role": "assistant", "content": "Done."}]
    data.write_text("\n".join(json.dumps({"messages": m}) for m in (conversation(), short)) + "\n")
    straight = _run_sft(tmp_path / "straight", policy_dir, steps=6)
    losses = [entry["loss"] for entry in straight.history]
    assert losses[-1] < losses[0] * 0.8, losses

    with pytest.raises(_Stop):
        _run_sft(tmp_path / "resumed", policy_dir, steps=6, stop_after=3)
    resumed = _run_sft(tmp_path / "resumed", policy_dir, steps=6)
    assert resumed.resumed_from_step == 3
    assert [entry["loss"] for entry in resumed.history] == pytest.approx(losses[3:], abs=1e-6)
    final = load_checkpoint(resumed.final_checkpoint)[0].state_dict()
    expected = load_checkpoint(straight.final_checkpoint)[0].state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(final[name], tensor, atol=1e-6, rtol=0, msg=name)

    # The checkpoint carries the imported tokenizer and template; exported, transformers reloads it.
    checkpoint = resumed.final_checkpoint
    assert (checkpoint / HF_SUBDIR / "tokenizer.json").is_file() and not (checkpoint / "tokenizer.json").exists()
    model, tokenizer, _ = load_checkpoint(checkpoint)
    assert isinstance(tokenizer, HFTokenizer)
    out = tmp_path / "exported"
    export_checkpoint(checkpoint, out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    messages = conversation()
    for message in messages:  # transformers' convention: tool-call arguments as objects
        for call in message.get("tool_calls", ()):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text == tokenizer.chat.render(messages, add_generation_prompt=False)
    ids = tokenizer.encode(text)
    assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    batch = torch.tensor([ids[:200]])
    with torch.no_grad():
        torch.testing.assert_close(model(batch, compute_router_losses=False).logits,
                                   reloaded(input_ids=batch).logits, atol=1e-5, rtol=0)


def test_checkpoint_of_an_imported_model_round_trips_its_files(policy_dir, tmp_path):
    model, tokenizer, meta = load_checkpoint(policy_dir)
    assert meta["family"] == "qwen3_moe" and isinstance(tokenizer, HFTokenizer)
    saved = save_checkpoint(tmp_path / "ckpt", model, tokenizer, {"source": "test"})
    again, tokenizer_again, meta_again = load_checkpoint(saved)
    assert meta_again["tokenizer"] == "hf" and tokenizer_again.to_json() == tokenizer.to_json()
    assert tokenizer_again.chat.template == tokenizer.chat.template
    assert tokenizer_again.stop_token_ids == tokenizer.stop_token_ids == (tokenizer.backend.token_to_id("<|im_end|>"),)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values(), strict=True))
    # Precision is the run's choice: MXFP8 experts on the same weights.
    mx, _, _ = load_checkpoint(saved, precision="mxfp8")
    assert mx.config.precision == "mxfp8" and torch.equal(mx.layers[0].feed_forward.w_gate, model.layers[0].feed_forward.w_gate)


def test_export_command_writes_a_directory_transformers_loads(policy_dir, tmp_path):
    from training.hf.policy import main

    model, tokenizer, _ = load_checkpoint(policy_dir)
    with torch.no_grad():
        for parameter in model.parameters():  # a "trained" policy: not the imported weights any more
            parameter.add_(0.01)
    saved = save_checkpoint(tmp_path / "ckpt", model, tokenizer, {"source": "test"})
    assert main([str(saved), str(tmp_path / "out")]) == 0
    with pytest.raises(SystemExit):
        main([str(saved), str(tmp_path / "out")])  # never over an existing export
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    batch = torch.tensor([tokenizer.encode(tokenizer.chat.render(conversation(), add_generation_prompt=False))[:120]])
    with torch.no_grad():
        ours = model(batch, compute_router_losses=False).logits
        torch.testing.assert_close(reloaded(input_ids=batch).logits, ours, atol=1e-5, rtol=0)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == tokenizer.chat.template
