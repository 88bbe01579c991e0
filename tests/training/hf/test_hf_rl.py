"""GRPO on an imported model: rollouts rendered by its own template in real sandboxes, the one Learner with
routing replay and MXFP8 experts, exact resume, and the synchronous rl() loop end to end."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from sandboxes import get_backend
from tests.training.hf.policy_models import save_policy_directory
from training.agent.config import AgentLimits
from training.checkpoint import load_checkpoint
from training.hf.policy import HF_SUBDIR, HFTokenizer
from training.serving import ChatModel
from training.tasks.toy import generate_toy_task
from training.train.learner import Learner
from training.train.loop import OptimizerConfig
from training.train.rl import RLConfig, rl
from training.train.rollouts import rollouts_collect
from training.train.segments import segments_to_batches

pytest.importorskip("transformers")
LIMITS = AgentLimits(max_turns=1, max_tokens=64, max_tokens_per_turn=16, context_tokens=8192, temperature=1.0)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("imported-rl") / "qwen3-moe-tiny"
    save_policy_directory(directory)
    return directory


@pytest.fixture(scope="module")
def records(policy_dir):
    """Real rollouts of the imported policy (MXFP8 experts) on two toy tasks in local sandboxes."""
    model, tokenizer, _ = load_checkpoint(policy_dir, precision="mxfp8")
    chat_model = ChatModel.for_policy(model, tokenizer, name="hf-policy")
    try:
        made = rollouts_collect(
            tasks=[generate_toy_task(0), generate_toy_task(1)], group_size=2, backend=get_backend("local"),
            chat_model=chat_model, limits=LIMITS, seed=5,
        )
    finally:
        chat_model.close()
    return made


def _scored(records, rewards):
    return [dataclasses.replace(record, reward=reward) for record, reward in zip(records, rewards, strict=True)]


class _MXFP8Calls:
    """Counts the MXFP8 grouped-expert autograd function's calls (the path precision="mxfp8" selects)."""

    def __init__(self, monkeypatch) -> None:
        from kernels import moe_experts

        self.calls = 0
        original = moe_experts.MXFP8GroupedSwiGLU.apply

        def counted(*args):
            self.calls += 1
            return original(*args)

        monkeypatch.setattr(moe_experts.MXFP8GroupedSwiGLU, "apply", counted)


def test_rollouts_render_with_the_models_template_and_segments_match(policy_dir, records):
    from sandboxes.tools import openai_tool_schemas

    tokenizer = HFTokenizer.from_directory(policy_dir)
    assert all(record.valid for record in records), [record.status for record in records]
    for record in records:
        segment = record.segments[0]
        messages = record.agent_result.messages
        prompt = tokenizer.chat.render(messages[:2], tools=openai_tool_schemas(), add_generation_prompt=True)
        assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
        assert segment.prompt_token_ids == tokenizer.encode(prompt)
        # The agent's turn is the family parser's reading of the sampled text.
        content, calls = tokenizer.chat.parse(tokenizer.decode(segment.token_ids))
        if not calls:
            assert messages[2]["role"] == "assistant" and messages[2]["content"] == content
        # The training row: the rendered prompt as context, exactly the sampled tokens in the loss.
        (batch,) = segments_to_batches(records=[record], advantages=torch.tensor([1.0]), micro_batch_size=1,
                                       pad_id=tokenizer.pad_id, with_routing=True)
        mask = batch.loss_mask[0].bool()
        assert batch.targets[0][mask].tolist() == segment.token_ids
        first = int(mask.nonzero()[0])
        assert batch.input_ids[0, : first + 1].tolist() == segment.prompt_token_ids
        assert batch.routed_experts is not None


def _config(policy_dir, run_dir, **overrides) -> RLConfig:
    values = dict(run_dir=str(run_dir), init_checkpoint=str(policy_dir), tasks=2, tasks_per_step=2, group_size=2,
                  steps=3, precision="mxfp8", max_turns=1, max_tokens_per_turn=16, sandbox_backend="local",
                  optimizer=OptimizerConfig(lr=3e-3, warmup_steps=0, weight_decay=0.0, min_lr_ratio=0.1))
    return RLConfig(**{**values, **overrides})


def test_grpo_update_on_imported_moe_uses_mxfp8_replays_routing_and_lowers_the_loss(policy_dir, records, tmp_path,
                                                                                   monkeypatch):
    calls = _MXFP8Calls(monkeypatch)
    learner = Learner(_config(policy_dir, tmp_path))
    assert learner.model.config.precision == "mxfp8" and learner.config.routing_replay
    learner.restore(tmp_path)
    scored = _scored(records, [1.0, 0.0, 0.0, 1.0])
    first = learner.update(scored)
    assert calls.calls > 0  # the learner's experts ran the MXFP8 path (forward and backward)
    assert first.stats["trained_tokens"] == sum(record.completion_tokens for record in records)
    # Routing replay + the same MXFP8 numerics: the learner reproduces the sampler's logprobs up to bf16 and the
    # quantisation's sensitivity to the decode-vs-full-forward rounding. Measured per token: 3e-4 when the engine
    # decoded through MoETransformer.forward, 1.1e-2 since qk-norm models decode through the fused path (bf16,
    # another operation order; fp32 gives 1e-6 either way).
    assert first.stats["logprob_mismatch"] < 3e-2
    second = learner.update(scored)
    assert second.stats["loss"] < first.stats["loss"] - 1e-4


def test_learner_of_an_imported_model_resumes_exactly(policy_dir, records, tmp_path):
    scored = _scored(records, [1.0, 0.0, 0.0, 1.0])
    straight = Learner(_config(policy_dir, tmp_path / "a"))
    straight.restore(tmp_path / "a")
    for _ in range(3):
        straight.update(scored)
    after_straight = torch.rand(4)

    part = Learner(_config(policy_dir, tmp_path / "b"))
    part.restore(tmp_path / "b")
    part.update(scored)
    part.save(run_dir=tmp_path / "b", step=1, data_position={"step": 1}, run_config={}, metrics={}, keep_last=2)
    checkpoint = tmp_path / "b" / "checkpoints" / "step-00000001"
    assert (checkpoint / HF_SUBDIR / "tokenizer_config.json").is_file()
    torch.rand(100)  # the process goes on drawing; the resume must restore the saved RNG
    resumed = Learner(_config(policy_dir, tmp_path / "b"))
    assert resumed.restore(tmp_path / "b") == {"step": 1}
    assert isinstance(resumed.tokenizer, HFTokenizer)
    for _ in range(2):
        resumed.update(scored)
    assert torch.equal(torch.rand(4), after_straight)
    assert resumed.lr_schedule.get_last_lr() == straight.lr_schedule.get_last_lr()
    for (name, expected), actual in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(),
                                        strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0, msg=name)
    expected_state = straight.optimizer.state_dict()["state"]
    for key, value in resumed.optimizer.state_dict()["state"].items():
        for field, tensor in value.items():
            torch.testing.assert_close(tensor, expected_state[key][field], atol=1e-6, rtol=0)


def test_sync_rl_loop_on_an_imported_model_runs_checkpoints_and_resumes(policy_dir, tmp_path, monkeypatch):
    calls = _MXFP8Calls(monkeypatch)
    config = _config(policy_dir, tmp_path / "run", steps=2, tasks_per_step=1)
    seen = []
    history = rl(config, on_rollouts=lambda step, records, advantages: seen.extend(records))
    assert [row["step"] for row in history] == [1, 2]
    assert calls.calls > 0  # the rollout engine's experts (and the learner's, when a group disagrees) ran MXFP8
    assert len(seen) == 4 and all(record.valid for record in seen)
    assert all(record.segments[0].prompt_token_ids[:1] == seen[0].segments[0].prompt_token_ids[:1] for record in seen)
    rows = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    model, tokenizer, _ = load_checkpoint(checkpoint)
    assert isinstance(tokenizer, HFTokenizer) and model.config.precision == "mxfp8"
    again = rl(dataclasses.replace(config, steps=3))
    assert [row["step"] for row in again] == [3]


def test_ray_driver_on_an_imported_model_renders_with_its_template_and_checkpoints(policy_dir, tmp_path):
    """The one driver (private local Ray): inference actors serve the imported model (MXFP8 experts) with its
    own template, the learner checkpoints it with its tokenizer, and starting the finished run again resumes."""
    from sandboxes.tools import openai_tool_schemas
    from training.rollout.config import AsyncRLConfig
    from training.rollout.driver import METRICS_FILE, read_jsonl, run_async_rl

    config = AsyncRLConfig(
        run_dir=str(tmp_path / "run"), init_checkpoint=str(policy_dir), precision="mxfp8", steps=2, tasks=2,
        group_size=2, groups_per_step=1, max_staleness=0, rollout_workers=2, max_turns=1, max_tokens_per_turn=8,
        context_tokens=8192, ray_num_cpus=1,
    )
    traces = []
    history = run_async_rl(config, on_rollout=lambda row: traces.append(row["trace"]))
    assert [row["step"] for row in history] == [1, 2] and len(traces) == 4
    tokenizer = HFTokenizer.from_directory(policy_dir)
    for trace in traces:
        # One model call per rollout: its prompt is the model's own rendering of the system prompt and task.
        prompt = tokenizer.chat.render(trace["messages"][:2], tools=openai_tool_schemas(), add_generation_prompt=True)
        assert trace["prompt_tokens"] == len(tokenizer.encode(prompt))
    model, tokenizer_again, _ = load_checkpoint(tmp_path / "run" / "checkpoints" / "step-00000002")
    assert isinstance(tokenizer_again, HFTokenizer) and model.config.precision == "mxfp8"
    assert run_async_rl(config) == [] and len(read_jsonl(tmp_path / "run" / METRICS_FILE)) == 2
