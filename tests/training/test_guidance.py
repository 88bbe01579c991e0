"""Expert guidance: the scripted expert's verified solution as a GRPO group member (training.train.guidance).

Real sandboxes (local backend) run the expert; the learner is the tiny random MoE model.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from sandboxes import get_backend
from sandboxes.tools import openai_tool_schemas
from training.agent.config import AgentLimits
from training.chat_format import encode_messages, parse_assistant_output
from training.checkpoint import create_random_checkpoint, load_checkpoint
from training.tasks.toy import generate_toy_task
from training.train.grpo import GRPOConfig
from training.train.guidance import EXPERT_STATUS, expert_record_create, expert_segments
from training.train.loop import OptimizerConfig, build_optimizer
from training.train.rl import (
    RLConfig,
    policy_updates,
    rollout_advantages,
    segment_logprobs,
    segments_to_batches,
)
from training.train.rollouts import RolloutRecord
from training.train.scripted_expert import expert_trajectory_create

TEMPERATURE = 1.2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return create_random_checkpoint(tmp_path_factory.mktemp("policy"), "tiny", seed=0, max_seq_len=4096)


@pytest.fixture(scope="module")
def trajectory():
    limits = AgentLimits(max_turns=5, context_tokens=4096)
    return expert_trajectory_create(task=generate_toy_task(3), backend=get_backend("local"), limits=limits)


def test_expert_segments_are_tokenized_as_the_served_model_meets_the_conversation(checkpoint, trajectory):
    _, tokenizer, _ = load_checkpoint(checkpoint)
    segments = expert_segments(messages=trajectory.messages, tokenizer=tokenizer)
    assistant_indices = [i for i, m in enumerate(trajectory.messages) if m["role"] == "assistant"]
    assert len(segments) == len(assistant_indices) == 4  # read, fix, test, final answer
    for segment, index in zip(segments, assistant_indices, strict=True):
        assert segment.prompt_token_ids == encode_messages(tokenizer, trajectory.messages[:index], openai_tool_schemas())
        content, calls = parse_assistant_output(tokenizer.decode(segment.token_ids))
        expected = trajectory.messages[index]
        assert content == expected["content"]
        assert [call["function"]["name"] for call in calls] == [
            call["function"]["name"] for call in expected.get("tool_calls", [])
        ]
    # Tool-calling turns end where generation stops (the end of the call block), the answer at the turn's end.
    assert [segment.token_ids[-1] for segment in segments] == [tokenizer.tool_calls_end_id] * 3 + [tokenizer.turn_end_id]
    # Each turn's prompt extends the previous prompt and completion, so the update merges them into one row.
    for earlier, later in zip(segments, segments[1:], strict=False):
        assert later.prompt_token_ids[: len(earlier.prompt_token_ids) + len(earlier.token_ids)] == (
            earlier.prompt_token_ids + earlier.token_ids
        )


def test_the_expert_member_has_ratio_one_and_the_update_raises_its_probability(checkpoint, trajectory):
    model, tokenizer, _ = load_checkpoint(checkpoint)
    model.train()
    guide = expert_record_create(
        task_id=trajectory.task_id, group=0, messages=trajectory.messages, reward=trajectory.reward,
        tokenizer=tokenizer, model=model, temperature=TEMPERATURE,
    )
    assert guide.status == EXPERT_STATUS and guide.passed and guide.reward == 1.0
    failed = [RolloutRecord(task_id=trajectory.task_id, group=0, valid=True, reward=0.0) for _ in range(3)]
    records = [*failed, guide]
    advantages = rollout_advantages(records, GRPOConfig())
    assert advantages.tolist() == pytest.approx([-0.25, -0.25, -0.25, 0.75])
    # The update merges the expert's turns into one row, as it does a rollout's; the learner's logprobs
    # there are the recorded ones, so the importance ratio is 1 (up to float rounding).
    batches = segments_to_batches(
        records=records, advantages=advantages, micro_batch_size=1, pad_id=tokenizer.pad_id, with_routing=True,
    )
    assert len(batches) == 1 and batches[0].routed_experts is None
    (batch,) = batches
    mask = batch.loss_mask.bool()
    assert int(mask.sum()) == sum(len(segment.token_ids) for segment in guide.segments)
    with torch.no_grad():
        before = segment_logprobs(model, batch, temperature=TEMPERATURE, routing_replay=True)[mask]
    assert torch.allclose(before, batch.behaviour_logprobs[mask], atol=1e-4)

    config = RLConfig(
        run_dir="unused", init_checkpoint=str(checkpoint), temperature=TEMPERATURE,
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0, min_lr_ratio=1.0),
    )
    optimizer = build_optimizer(model, config.optimizer)
    stats = policy_updates(model=model, optimizer=optimizer, batches=batches, config=config)
    assert stats["clip_fraction"] == 0.0 and stats["mean_ratio"] == pytest.approx(1.0, abs=1e-4)
    with torch.no_grad():
        after = segment_logprobs(model, batch, temperature=TEMPERATURE, routing_replay=True)[mask]
    assert float(after.sum()) > float(before.sum()) + 1.0


def test_a_run_with_expert_guidance_trains_on_groups_where_every_rollout_failed(checkpoint, tmp_path):
    """A random policy never passes: without guidance no update trains (see test_rollout_driver.py); with it
    every group gets the expert's member, the update trains on it and the weights move."""
    from training.rollout.driver import METRICS_FILE, ROLLOUTS_FILE, AsyncRLConfig, read_jsonl, run_async_rl
    from training.train.state import latest_checkpoint

    config = AsyncRLConfig(
        run_dir=str(tmp_path / "run"), init_checkpoint=str(checkpoint), steps=2, lr=1e-3, tasks=2, group_size=2,
        groups_per_step=1, max_staleness=0, rollout_workers=2, max_turns=4, max_tokens_per_turn=64,
        ray_num_cpus=1, sandbox_backend="local", expert_guidance=True, temperature=TEMPERATURE,
    )
    run_async_rl(config)
    metrics = read_jsonl(tmp_path / "run" / METRICS_FILE)
    assert [row["pass_rate"] for row in metrics] == [0.0, 0.0]
    assert [(row["guided_groups"], row["guide_failures"]) for row in metrics] == [(1, 0), (1, 0)]
    assert all(row["loss"] != 0.0 for row in metrics)
    rows = read_jsonl(tmp_path / "run" / ROLLOUTS_FILE)
    # The logs hold the policy's rollouts only (each marked as guided); the expert is not a sampled rollout.
    assert len(rows) == 4 and all(row["guided"] and row["advantage"] < 0 for row in rows)
    trained = load_file(str(latest_checkpoint(tmp_path / "run") / "model.safetensors"))
    initial = load_file(str(checkpoint / "model.safetensors"))
    assert any(not torch.equal(trained[name], initial[name]) for name in initial)
