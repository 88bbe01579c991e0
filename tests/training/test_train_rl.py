"""RL stage on the tiny model: real sandboxes, real hidden-test rewards, masking, the GRPO update."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from sandboxes import get_backend
from training.agent.config import AgentLimits
from training.checkpoint import create_random_checkpoint, load_checkpoint
from training.rollout.run_dir import RolloutRow
from training.serving import ChatModel
from training.tasks.sandboxing import task_sandboxes_create
from training.tasks.toy import generate_toy_task
from training.train.grpo import GRPOConfig
from training.train.loop import (
    OptimizerConfig,
    TrainConfigError,
    build_optimizer,
    build_scheduler,
    read_metrics,
)
from training.train.rl import (
    RLConfig,
    policy_updates,
    reference_model_load,
    rl,
    rollout_advantages,
    segment_logprobs,
    segment_logprobs_and_entropy,
    segments_to_batches,
)
from training.train.rollouts import rollout_run, rollouts_collect

LIMITS = AgentLimits(max_turns=1, max_tokens=64, max_tokens_per_turn=16, context_tokens=4096, temperature=1.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # The system prompt with every tool schema is ~2.4k tokens, so the tiny model gets a 4k context.
    return create_random_checkpoint(tmp_path_factory.mktemp("policy"), "tiny", seed=0, max_seq_len=4096)


@pytest.fixture(scope="module")
def rollouts(checkpoint):
    model, tokenizer, _ = load_checkpoint(checkpoint)
    chat_model = ChatModel(model, tokenizer, name="test-policy")
    try:
        records = rollouts_collect(
            tasks=[generate_toy_task(0), generate_toy_task(1)], group_size=2, backend=get_backend("local"),
            chat_model=chat_model, limits=LIMITS, seed=11,
        )
    finally:
        chat_model.close()
    return records


def test_rollouts_run_in_sandboxes_and_are_scored_by_hidden_tests(rollouts):
    assert [(r.task_id, r.group) for r in rollouts] == [("toy-0", 0), ("toy-0", 0), ("toy-1", 1), ("toy-1", 1)]
    for record in rollouts:
        assert record.valid, record.status
        assert record.tests_total > 0  # the hidden suite really ran in the sandbox
        assert record.reward == 0.0 and not record.passed  # a random model does not fix the bug
        segment = record.segments[0]
        assert len(segment.token_ids) == len(segment.logprobs) <= 16
        assert segment.routed_experts.shape[0] == len(segment.prompt_token_ids) + len(segment.token_ids) - 1
    # Different seeds within a group sample different completions.
    assert rollouts[0].segments[0].token_ids != rollouts[1].segments[0].token_ids


def test_infrastructure_failure_is_masked_not_scored_zero(checkpoint, rollouts):
    task = generate_toy_task(0)
    sandbox = task_sandboxes_create(backend=get_backend("local"), task=task)[0]
    sandbox.destroy()  # a real infrastructure failure: the sandbox vanished under the rollout
    model, tokenizer, _ = load_checkpoint(checkpoint)
    chat_model = ChatModel(model, tokenizer, name="masked")
    try:
        failed = rollout_run(task=task, group=0, sandbox=sandbox, chat_model=chat_model, limits=LIMITS, seed=3)
    finally:
        chat_model.close()
    assert not failed.valid and failed.reward is None and failed.status.startswith("infrastructure")

    good, bad = rollouts[0], rollouts[1]
    good.reward = 1.0  # give the group a signal; the failed rollout joins it
    try:
        failed.group, failed.task_id = good.group, good.task_id
        records = [good, bad, failed]
        advantages = rollout_advantages(records, GRPOConfig())
        # Baseline over the two valid rollouts only (0.5); scoring the failure as 0 would give 1/3.
        assert advantages.tolist() == pytest.approx([0.5, -0.5, 0.0])
        batches = segments_to_batches(records=records, advantages=advantages, micro_batch_size=8, pad_id=0,
                                      with_routing=True)
        assert batches[0].input_ids.shape[0] == len(good.segments) + len(bad.segments)
    finally:
        good.reward = 0.0


def _batches_with_first_rollout_rewarded(good, bad):
    """Training batches of one group in which `good` passed and `bad` did not (the records are left unchanged)."""
    good.reward = 1.0
    try:
        advantages = rollout_advantages([good, bad], GRPOConfig())
        return segments_to_batches(records=[good, bad], advantages=advantages, micro_batch_size=1, pad_id=0,
                                   with_routing=True)
    finally:
        good.reward = 0.0


def test_grpo_update_moves_probability_towards_the_better_rollout(checkpoint, rollouts):
    model, _, _ = load_checkpoint(checkpoint)
    model.train()
    good, bad = rollouts[0], rollouts[1]
    batches = _batches_with_first_rollout_rewarded(good, bad)
    config = RLConfig(run_dir="unused", init_checkpoint=str(checkpoint), tasks=1, tasks_per_step=1, group_size=2,
                      updates_per_step=2, optimizer=OptimizerConfig(lr=1e-4, warmup_steps=0, weight_decay=0.0))

    def completion_logprob(batch) -> float:
        with torch.no_grad():
            logprobs = segment_logprobs(model, batch, temperature=1.0, routing_replay=True)
        return float((logprobs * batch.loss_mask).sum())

    before = [completion_logprob(batch) for batch in batches]
    stats = policy_updates(model=model, optimizer=build_optimizer(model, config.optimizer), batches=batches,
                           config=config)
    after = [completion_logprob(batch) for batch in batches]
    assert after[0] > before[0] and after[1] < before[1], (before, after)
    # Same weights as the rollout policy before the first update: train and rollout logprobs agree.
    assert stats["logprob_mismatch"] < 1e-3
    assert stats["trained_tokens"] == sum(len(s.token_ids) for r in (good, bad) for s in r.segments)


def test_kl_penalty_keeps_the_update_nearer_the_reference_policy(checkpoint, rollouts):
    """The same GRPO step from a policy that has drifted, with and without the penalty to its starting point."""
    batches = _batches_with_first_rollout_rewarded(rollouts[0], rollouts[1])

    def kl_after_update(kl_coef: float) -> tuple[float, dict]:
        config = RLConfig(run_dir="unused", init_checkpoint=str(checkpoint), tasks=1, tasks_per_step=1, group_size=2,
                          updates_per_step=3, grpo=GRPOConfig(kl_coef=kl_coef),
                          optimizer=OptimizerConfig(lr=3e-3, warmup_steps=0, weight_decay=0.0))
        reference = reference_model_load(config)
        assert (reference is None) == (kl_coef == 0)
        starting_policy, _, _ = load_checkpoint(checkpoint)
        model, _, _ = load_checkpoint(checkpoint)
        torch.manual_seed(3)
        with torch.no_grad():  # the drift an earlier part of the run left behind
            for parameter in model.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
        model.train()
        stats = policy_updates(model=model, optimizer=build_optimizer(model, config.optimizer), batches=batches,
                               config=config, reference_model=reference)
        total = 0.0
        with torch.no_grad():
            for batch in batches:
                policy = segment_logprobs(model, batch, temperature=1.0, routing_replay=False)
                anchor = segment_logprobs(starting_policy, batch, temperature=1.0, routing_replay=False)
                gap = torch.where(batch.loss_mask.bool(), anchor - policy, 0.0)
                total += float((gap.exp() - gap - 1).sum())
        return total, stats

    free_kl, free_stats = kl_after_update(0.0)
    anchored_kl, anchored_stats = kl_after_update(0.9)
    assert free_stats["kl_to_reference"] is None and anchored_stats["kl_to_reference"] > 0
    assert anchored_kl < free_kl, (anchored_kl, free_kl)
    config = RLConfig(run_dir="unused", init_checkpoint=str(checkpoint), tasks=1, tasks_per_step=1, group_size=2,
                      grpo=GRPOConfig(kl_coef=0.1))
    model, _, _ = load_checkpoint(checkpoint)
    with pytest.raises(ValueError, match="pass reference_model=reference_model_load"):
        policy_updates(model=model, optimizer=build_optimizer(model, config.optimizer), batches=batches, config=config)


def test_rl_loop_end_to_end_with_resume(checkpoint, tmp_path):
    kwargs = {"run_dir": str(tmp_path / "rl"), "init_checkpoint": str(checkpoint), "tasks": 2, "tasks_per_step": 1,
              "group_size": 2, "max_turns": 1, "max_tokens_per_turn": 12, "seed": 5,
              "optimizer": OptimizerConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0, min_lr_ratio=0.1)}
    first = rl(RLConfig(steps=1, **kwargs))
    assert [m["step"] for m in first] == [1]
    assert first[0]["valid_rollouts"] == 2 and first[0]["masked_rollouts"] == 0
    assert first[0]["mean_reward"] == 0.0
    resumed = rl(RLConfig(steps=2, **kwargs))
    assert [m["step"] for m in resumed] == [2]  # resumed after the step-1 checkpoint
    assert [m["step"] for m in read_metrics(tmp_path / "rl")] == [1, 2]
    rows = [json.loads(line) for line in (tmp_path / "rl" / "rollouts.jsonl").read_text().splitlines()]
    # One line per rollout in the driver's schema (training.rollout.run_dir.RolloutRow), the web app's reading.
    assert [row["step"] for row in rows] == [1, 1, 2, 2]
    assert set(rows[0]) == {item.name for item in dataclasses.fields(RolloutRow)}
    assert {row["task_id"] for row in rows if row["step"] == 2} == {"toy-1"}  # tasks follow the step, not the process
    assert [row["sample_index"] for row in rows] == [0, 1, 0, 1] and len({row["rollout_id"] for row in rows}) == 4
    assert all(row["policy_version"] == row["step"] - 1 and row["staleness"] == 0 for row in rows)
    metrics = read_metrics(tmp_path / "rl")
    # One metric vocabulary with the driver, and one schedule rule: it steps per version, trained or not.
    assert all("pass_rate" in row and "success_rate" not in row for row in metrics)
    assert [row["trained_tokens"] for row in metrics] == [0, 0]  # a random policy never passes: groups agree
    # The schedule stepped after the untrained first update (the first call's 1-step cosine from lr to 0.1 lr
    # ends there, and the resumed call continues from the checkpointed schedule); a schedule that waited for
    # trained updates would still be at lr.
    assert [row["lr"] for row in metrics] == pytest.approx([1e-3, 1e-4])
    loaded, _, meta = load_checkpoint(tmp_path / "rl" / "checkpoints" / "step-00000002")
    assert meta["step"] == 2 and loaded.config.max_seq_len == 4096


def test_rl_config_errors_say_how_to_fix(checkpoint):
    with pytest.raises(TrainConfigError, match="group_size must be >= 2"):
        RLConfig(run_dir="x", init_checkpoint=str(checkpoint), group_size=1)
    with pytest.raises(TrainConfigError, match="top_p must be 1.0"):
        RLConfig(run_dir="x", init_checkpoint=str(checkpoint), top_p=0.9)
    with pytest.raises(TrainConfigError, match="exceeds the pool"):
        RLConfig(run_dir="x", init_checkpoint=str(checkpoint), tasks=1, tasks_per_step=2)


@pytest.mark.django_db
def test_rl_command_stores_rollouts_for_the_trace_browser(checkpoint, owner, tmp_path):
    from django.core.management import call_command

    from webapp.agents.models import AgentTask

    call_command("rl", "--run-dir", str(tmp_path / "rl"), "--init-checkpoint", str(checkpoint), "--tasks", "1",
                 "--tasks-per-step", "1", "--group-size", "2", "--steps", "1", "--max-turns", "1",
                 "--max-tokens-per-turn", "8", "--record-owner", owner.username, "--experiment-name", "ci-rl")
    stored = AgentTask.objects.filter(experiment_name="ci-rl", owner=owner)
    assert stored.count() == 2
    assert {(task.training_step, task.reward, task.repo_label) for task in stored} == {(1, 0.0, "toy-0")}
    assert all(task.messages and task.events.exists() for task in stored)


def test_groups_without_signal_take_no_step(checkpoint, rollouts):
    """All rollouts scored alike: no rows to train, and no Adam step drifting along stale momentum."""
    model, _, _ = load_checkpoint(checkpoint)
    advantages = rollout_advantages(rollouts, GRPOConfig())
    assert advantages.tolist() == [0.0] * len(rollouts)
    batches = segments_to_batches(records=rollouts, advantages=advantages, micro_batch_size=2, pad_id=0,
                                  with_routing=True)
    assert batches == []
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2, warmup_steps=0))
    for parameter in model.parameters():  # momentum left over from an earlier step
        optimizer.state[parameter] = {"step": torch.tensor(1.0), "exp_avg": torch.ones_like(parameter),
                                      "exp_avg_sq": torch.ones_like(parameter)}
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    config = RLConfig(run_dir="unused", init_checkpoint=str(checkpoint), tasks=1, tasks_per_step=1, group_size=2)
    stats = policy_updates(model=model, optimizer=optimizer, batches=batches, config=config)
    assert stats["trained_tokens"] == 0
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_gain_lr_scale_gives_one_dimensional_parameters_their_own_step_size():
    """Adam's first step moves each parameter by ~lr: gains must move gain_lr_scale times further."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.LayerNorm(8))
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0, gain_lr_scale=10.0))
    before = [parameter.detach().clone() for parameter in model.parameters()]
    (model(torch.randn(16, 8)) * torch.randn(16, 8)).sum().backward()
    optimizer.step()
    matrix_step, gain_step, bias_step = (
        (parameter.detach() - old).abs().max().item() for parameter, old in zip(model.parameters(), before, strict=True)
    )
    assert matrix_step == pytest.approx(1e-3, rel=0.01)
    assert gain_step == pytest.approx(1e-2, rel=0.01) and bias_step == pytest.approx(1e-2, rel=0.01)
    with pytest.raises(TrainConfigError, match="gain_lr_scale must be positive"):
        OptimizerConfig(gain_lr_scale=0.0)


def test_decay_fraction_holds_the_peak_lr_then_anneals_over_the_last_share_of_steps():
    """Warmup-stable-decay: warmup over 2 steps, lr held until the last quarter of the 8 steps after it,
    then a cosine to min_lr_ratio * lr at the last step; decay_fraction=1 is the plain warmup + cosine."""
    model = torch.nn.Linear(4, 4)
    config = OptimizerConfig(lr=1.0, warmup_steps=2, weight_decay=0.0, min_lr_ratio=0.1, decay_fraction=0.25)
    schedule = build_scheduler(build_optimizer(model, config), config, total_steps=10)
    multipliers = [schedule.lr_lambdas[0](step) for step in range(11)]
    assert multipliers[:2] == pytest.approx([1 / 3, 2 / 3])
    assert multipliers[2:9] == pytest.approx([1.0] * 7)
    assert multipliers[9] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the 2 decay steps
    assert multipliers[10] == pytest.approx(0.1)
    plain = OptimizerConfig(lr=1.0, warmup_steps=2, weight_decay=0.0, min_lr_ratio=0.1)
    cosine = build_scheduler(build_optimizer(model, plain), plain, total_steps=10).lr_lambdas[0]
    assert cosine(6) == pytest.approx(0.1 + 0.9 * 0.5) and cosine(3) < 1.0
    with pytest.raises(TrainConfigError, match=r"decay_fraction must be in \(0, 1\]"):
        OptimizerConfig(decay_fraction=0.0)


def test_a_clock_moves_the_decay_when_it_is_further_along_than_the_steps():
    """With a time budget the decay's position is the later of the steps' and the clock's: at 80 % of the
    budget with few steps taken the lr is already a third of the way down the last 30 %'s cosine, and past
    the budget it stays at min_lr_ratio; a step count further along than the clock still leads."""
    model = torch.nn.Linear(4, 4)
    config = OptimizerConfig(lr=1.0, warmup_steps=2, weight_decay=0.0, min_lr_ratio=0.1, decay_fraction=0.3)
    clock = {"fraction": 0.0}
    schedule = build_scheduler(
        build_optimizer(model, config), config, total_steps=1000, time_fraction=lambda: clock["fraction"]
    ).lr_lambdas[0]
    assert schedule(1) == pytest.approx(2 / 3)  # the warmup counts steps whatever the clock says
    assert schedule(5) == pytest.approx(1.0)
    clock["fraction"] = 0.6
    assert schedule(5) == pytest.approx(1.0)  # before the decay's share of the budget
    clock["fraction"] = 0.8
    assert schedule(5) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 3)))
    clock["fraction"] = 1.5
    assert schedule(5) == pytest.approx(0.1)
    clock["fraction"] = 0.0
    assert schedule(1000) == pytest.approx(0.1)


def test_turns_that_extend_each_other_share_a_row_with_the_same_gradient(checkpoint):
    """A rollout's second call repeats the first call's prompt and completion: merged into one row, the
    update's gradient is that of the two separate rows, and the shared prefix is computed once."""
    from training.train.rollouts import RolloutRecord, Segment

    model, _, _ = load_checkpoint(checkpoint)
    generator = torch.Generator().manual_seed(4)

    def tokens(count):
        return torch.randint(8, 2000, (count,), generator=generator).tolist()

    def routing(count):
        return torch.randint(0, model.config.n_experts, (count, model.config.n_layers, model.config.top_k),
                             generator=generator)

    first_prompt, first_completion = tokens(40), tokens(6)
    second_prompt = first_prompt + first_completion + tokens(12)
    second_completion = tokens(5)
    unrelated_prompt, unrelated_completion = tokens(30), tokens(4)  # re-rendered history: no common prefix
    # the same weights route the shared prefix the same way in both calls
    first_routing = routing(45)
    second_routing = torch.cat([first_routing, routing(17)])
    segments = [
        Segment(first_prompt, first_completion, [-1.0] * 6, first_routing),
        Segment(second_prompt, second_completion, [-2.0] * 5, second_routing),
        Segment(unrelated_prompt, unrelated_completion, [-1.5] * 4, routing(33)),
    ]
    record = RolloutRecord(task_id="t", group=0, valid=True, reward=1.0, passed=True, segments=segments)
    advantages = torch.tensor([0.5])

    def gradient(merge):
        batches = segments_to_batches(records=[record], advantages=advantages, micro_batch_size=1, pad_id=0,
                                      with_routing=True, merge_turns=merge)
        model.zero_grad()
        total = float(sum(batch.loss_mask.sum() for batch in batches))
        for batch in batches:
            logprobs = segment_logprobs(model, batch, temperature=0.8, routing_replay=True)
            loss = -(logprobs * batch.loss_mask * batch.advantages[:, None]).sum() / total
            loss.backward()
        return batches, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    merged_batches, merged = gradient(True)
    separate_batches, separate = gradient(False)
    assert len(merged_batches) == 2 and len(separate_batches) == 3
    assert merged_batches[0].input_ids.shape[1] == len(second_prompt) + len(second_completion) - 1
    assert merged_batches[0].loss_mask.sum() == 11
    assert torch.equal(merged_batches[0].routed_experts[0], second_routing.long())
    assert torch.equal(merged_batches[0].behaviour_logprobs[0, 39:45], torch.full((6,), -1.0))
    torch.testing.assert_close(merged, separate, rtol=1e-4, atol=1e-6)


def test_shared_prefix_groups_never_cut_a_formed_groups_prefix_short():
    """Rows 0-1 share 100 tokens; row 2 agrees with them for 70 only (a later version's routing flips
    there): it starts its own group instead of shrinking theirs to 70, and row 3, which agrees with row 2,
    joins it. A row without loss positions, or of two rows, runs alone."""
    import dataclasses

    from training.train.rl import TrainingSegments, shared_prefix_groups

    def row(tokens, first_loss=100, rows=1):
        length = len(tokens)
        loss_mask = torch.zeros(rows, length)
        loss_mask[:, first_loss:] = 1.0
        return TrainingSegments(
            input_ids=torch.tensor([tokens] * rows), targets=torch.zeros(rows, length, dtype=torch.long),
            loss_mask=loss_mask, behaviour_logprobs=torch.zeros(rows, length), advantages=torch.ones(rows),
            routed_experts=None,
        )

    base = list(range(10, 130))
    flipped = base[:70] + [5] * 50
    no_loss = dataclasses.replace(row(base), loss_mask=torch.zeros(1, len(base)))
    batches = [row(base), row(base), row(flipped), row(flipped), no_loss, row(base, rows=2)]
    assert shared_prefix_groups(batches, routing_replay=False) == [(100, [0, 1]), (100, [2, 3]), (0, [4]), (0, [5])]
    assert shared_prefix_groups(batches, routing_replay=False, min_tokens=101) == [(0, [i]) for i in range(6)]


def test_a_groups_shared_prefix_runs_once_in_the_learner_with_the_same_update(checkpoint, tmp_path):
    """Five rollouts of one task, sampled by two policy versions that routed the prompt differently and
    finished interleaved: each version's rollouts share the prompt in the learner (one prefix forward and
    backward per version). The update (SGD, so the weights move by the gradient) and its statistics equal
    those of running every row in full, with the copy constraint's masks, the entropy term and the KL to a
    reference policy all in play."""
    import copy

    from training.engine import SamplingMasks
    from training.train.rl import shared_prefix_groups
    from training.train.rollouts import RolloutRecord, Segment

    model, _, _ = load_checkpoint(checkpoint)
    config = model.config
    generator = torch.Generator().manual_seed(21)

    def tokens(count):
        return torch.randint(8, 2000, (count,), generator=generator).tolist()

    def routing(count):
        return torch.randint(0, config.n_experts, (count, config.n_layers, config.top_k), generator=generator)

    prompt = tokens(90)
    version_routing = [routing(90), routing(90)]
    records = []
    for index, version in enumerate((0, 1, 0, 0, 1)):
        completion, tool_output, second_completion = tokens(5 + index), tokens(7), tokens(4)
        first_routing = version_routing[version].clone()
        # routing covers every input position: all tokens of the call but its last
        first_routing = torch.cat([first_routing, routing(len(completion) - 1)])
        second_prompt = prompt + completion + tool_output
        second_routing = torch.cat([first_routing, routing(1 + len(tool_output) + len(second_completion) - 1)])
        allowed = torch.zeros(2, config.vocab_size, dtype=torch.bool)
        allowed[0, [second_completion[1], 9]] = True
        allowed[1, second_completion[2]] = True
        segments = [
            Segment(prompt, completion, [-1.0] * len(completion), first_routing),
            Segment(second_prompt, second_completion, [-1.5] * 4, second_routing, SamplingMasks([1, 2], allowed)),
        ]
        records.append(RolloutRecord(task_id="t", group=0, valid=True, reward=float(index % 2), passed=bool(index % 2),
                                     segments=segments))
    batches = segments_to_batches(records=records, advantages=torch.tensor([-0.5, 0.5, -0.5, 0.5, -0.5]),
                                  micro_batch_size=1, pad_id=0, with_routing=True)
    assert shared_prefix_groups(batches, routing_replay=True) == [(89, [0, 2, 3]), (89, [1, 4])]
    assert shared_prefix_groups(batches, routing_replay=False) == [(89, [0, 1, 2, 3, 4])]

    rl_config = RLConfig(
        run_dir=str(tmp_path), init_checkpoint=str(checkpoint), temperature=0.9, routing_replay=True,
        grpo=GRPOConfig(entropy_coef=-0.5, entropy_scope="positive", kl_coef=0.05),
    )
    reference = copy.deepcopy(model)
    with torch.no_grad():  # a reference that differs from the policy, so the KL term has a gradient
        for parameter in reference.parameters():
            parameter.add_(0.01 * torch.randn(parameter.shape, generator=generator))

    def update(share):
        policy = copy.deepcopy(model)
        optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        stats = policy_updates(model=policy, optimizer=optimizer, batches=batches, config=rl_config,
                               reference_model=reference, share_prefixes=share)
        delta = torch.cat([(after - before).flatten() for after, before in zip(policy.parameters(), model.parameters(), strict=True)])
        return delta, stats

    shared_delta, shared_stats = update(True)
    full_delta, full_stats = update(False)
    assert full_delta.abs().max() > 1e-4  # the update moved the weights
    torch.testing.assert_close(shared_delta, full_delta, rtol=1e-4, atol=1e-6)
    for key in ("loss", "entropy", "kl_to_reference", "approx_kl", "logprob_mismatch", "grad_norm"):
        assert shared_stats[key] == pytest.approx(full_stats[key], rel=1e-4, abs=1e-7), key
    # 89 prompt tokens not recomputed for two rows of the first version and one of the second
    assert (shared_stats["shared_prefix_tokens"], full_stats["shared_prefix_tokens"]) == (3 * 89, 0)


def test_segment_logprobs_at_sampled_tokens_match_the_full_logits_forward(checkpoint):
    # segment_logprobs projects only the loss positions to the vocabulary; values and gradients must be
    # those of the plain forward over every position.
    from training.train.grpo import token_logprobs
    from training.train.rollouts import RolloutRecord, Segment

    model, _, _ = load_checkpoint(checkpoint)
    generator = torch.Generator().manual_seed(7)
    segments = []
    for prompt_length, completion_length in ((50, 7), (33, 4)):
        prompt = torch.randint(8, 2000, (prompt_length,), generator=generator).tolist()
        completion = torch.randint(8, 2000, (completion_length,), generator=generator).tolist()
        routing = torch.randint(0, model.config.n_experts,
                                (prompt_length + completion_length - 1, model.config.n_layers, model.config.top_k),
                                generator=generator)
        segments.append(Segment(prompt, completion, [-1.0] * completion_length, routing))
    record = RolloutRecord(task_id="t", group=0, valid=True, reward=1.0, passed=True, segments=segments)
    (batch,) = segments_to_batches(records=[record], advantages=torch.tensor([1.0]), micro_batch_size=2, pad_id=0,
                                   with_routing=True)
    assert batch.input_ids.shape[0] == 2 and batch.loss_mask.sum() == 11

    def loss_and_gradient(logprobs):
        model.zero_grad()
        loss = -(logprobs * batch.loss_mask).sum()
        loss.backward()
        return logprobs.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    sampled, sampled_gradient = loss_and_gradient(
        segment_logprobs(model, batch, temperature=0.8, routing_replay=True))
    full_logits = model(batch.input_ids, routing_override=batch.routed_experts).logits
    full, full_gradient = loss_and_gradient(token_logprobs(full_logits / 0.8, batch.targets))
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(sampled[mask], full[mask], rtol=1e-5, atol=1e-5)
    assert torch.all(sampled[~mask] == 0)
    torch.testing.assert_close(sampled_gradient, full_gradient, rtol=1e-4, atol=1e-6)


def test_segment_entropy_matches_the_full_softmax_at_the_sampled_tokens(checkpoint):
    from training.train.rollouts import RolloutRecord, Segment

    model, _, _ = load_checkpoint(checkpoint)
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(8, 2000, (40,), generator=generator).tolist()
    completion = torch.randint(8, 2000, (6,), generator=generator).tolist()
    routing = torch.randint(0, model.config.n_experts, (45, model.config.n_layers, model.config.top_k),
                            generator=generator)
    record = RolloutRecord(task_id="t", group=0, valid=True, reward=1.0, passed=True,
                           segments=[Segment(prompt, completion, [-1.0] * 6, routing)])
    (batch,) = segments_to_batches(records=[record], advantages=torch.tensor([1.0]), micro_batch_size=1, pad_id=0,
                                   with_routing=True)
    logprobs, entropies = segment_logprobs_and_entropy(model, batch, temperature=0.8, routing_replay=True)
    with torch.no_grad():
        full = torch.softmax(model(batch.input_ids, routing_override=batch.routed_experts).logits / 0.8, dim=-1)
    expected = -(full * full.log()).sum(-1)
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(entropies[mask], expected[mask], rtol=1e-4, atol=1e-5)
    assert torch.all(entropies[~mask] == 0) and torch.all(entropies[mask] > 0)
    torch.testing.assert_close(
        logprobs, segment_logprobs(model, batch, temperature=0.8, routing_replay=True), rtol=0, atol=0
    )


def test_the_learner_applies_the_constraint_masks_a_rollout_was_sampled_under(checkpoint):
    # Two merged calls of one rollout, each with tokens drawn under a copy-constraint mask. The learner's
    # logprobs there must be the masked distribution's (what the engine recorded): a forced token has
    # logprob 0, entropy 0 and no gradient; a token drawn among several gets the renormalised probability.
    from training.engine import SamplingMasks
    from training.train.rollouts import RolloutRecord, Segment

    model, _, _ = load_checkpoint(checkpoint)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(11)
    first_prompt = torch.randint(8, 2000, (30,), generator=generator).tolist()
    first_completion = torch.randint(8, 2000, (6,), generator=generator).tolist()
    second_prompt = first_prompt + first_completion + torch.randint(8, 2000, (9,), generator=generator).tolist()
    second_completion = torch.randint(8, 2000, (5,), generator=generator).tolist()
    forced = torch.zeros(1, vocab, dtype=torch.bool)
    forced[0, first_completion[2]] = True
    among_three = torch.zeros(2, vocab, dtype=torch.bool)
    for row, position in enumerate((1, 3)):
        among_three[row, [second_completion[position], 5, 6]] = True
    segments = [
        Segment(first_prompt, first_completion, [-1.0] * 6, None, SamplingMasks([2], forced)),
        Segment(second_prompt, second_completion, [-1.0] * 5, None, SamplingMasks([1, 3], among_three)),
    ]
    record = RolloutRecord(task_id="t", group=0, valid=True, reward=1.0, passed=True, segments=segments)
    (batch,) = segments_to_batches(records=[record], advantages=torch.tensor([1.0]), micro_batch_size=1, pad_id=0,
                                   with_routing=False)
    first, second = len(first_prompt) - 1, len(second_prompt) - 1
    assert batch.masked_positions.tolist() == [[0, first + 2], [0, second + 1], [0, second + 3]]
    assert torch.equal(batch.masked_allowed, torch.cat([forced, among_three]))

    model.zero_grad()
    logprobs, entropies = segment_logprobs_and_entropy(model, batch, temperature=0.8, routing_replay=False)
    with torch.no_grad():
        full = model(batch.input_ids).logits[0] / 0.8
    free = full.log_softmax(-1).gather(1, batch.targets[0][:, None]).squeeze(1)
    mask = batch.loss_mask[0].bool()
    assert logprobs[0, first + 2] == 0 and entropies[0, first + 2] == 0
    for row, position in enumerate((second + 1, second + 3)):
        allowed = full[position].masked_fill(~among_three[row], float("-inf")).log_softmax(-1)
        torch.testing.assert_close(logprobs[0, position], allowed[batch.targets[0, position]], rtol=1e-5, atol=1e-5)
        assert logprobs[0, position] > free[position]
        assert 0 < entropies[0, position] <= torch.log(torch.tensor(3.0)) + 1e-5
    unmasked = mask.clone()
    unmasked[[first + 2, second + 1, second + 3]] = False
    torch.testing.assert_close(logprobs[0][unmasked], free[unmasked], rtol=1e-5, atol=1e-5)

    # the forced token alone contributes nothing to the gradient (and no NaN from its -inf logits)
    only_forced = torch.zeros_like(logprobs)
    only_forced[0, first + 2] = 1.0
    ((logprobs + entropies) * only_forced).sum().backward()
    gradients = [p.grad for p in model.parameters() if p.grad is not None]
    assert gradients and all(torch.isfinite(g).all() and not g.any() for g in gradients)
