"""GRPO loss math: group advantages, masking of infrastructure failures, clipping, length penalty."""

from __future__ import annotations

import math

import pytest
import torch

from training.train.grpo import (
    GRPOConfig,
    GRPOConfigError,
    LengthPenaltyConfig,
    group_advantages,
    length_penalty,
    policy_loss,
    segment_advantages,
    shaped_rewards,
    token_logprobs,
)


def test_advantages_are_centred_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([7, 7, 7, 3, 3, 3])
    adv = group_advantages(rewards=rewards, valid=torch.ones(6, dtype=torch.bool), group_ids=groups)
    assert torch.allclose(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]))


def test_std_normalisation_is_optional():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    groups = torch.zeros(4, dtype=torch.long)
    valid = torch.ones(4, dtype=torch.bool)
    plain = group_advantages(rewards=rewards, valid=valid, group_ids=groups)
    scaled = group_advantages(rewards=rewards, valid=valid, group_ids=groups, normalize_std=True)
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std()
    assert torch.allclose(scaled, plain / (std + 1e-6))
    assert not torch.allclose(scaled, plain)


def test_infrastructure_failures_are_masked_not_scored_zero():
    # Rollout 2 crashed in the sandbox machinery: its reward is unknown (NaN), not zero.
    rewards = torch.tensor([1.0, 1.0, float("nan"), 0.0])
    valid = torch.tensor([True, True, False, True])
    groups = torch.zeros(4, dtype=torch.long)
    adv = group_advantages(rewards=rewards, valid=valid, group_ids=groups)
    # Baseline is the mean of the three valid rewards (2/3); scoring the crash as 0 would make it 1/2.
    assert torch.allclose(adv, torch.tensor([1 / 3, 1 / 3, 0.0, -2 / 3]))
    as_zero = group_advantages(
        rewards=torch.tensor([1.0, 1.0, 0.0, 0.0]), valid=torch.ones(4, dtype=torch.bool), group_ids=groups
    )
    assert not torch.allclose(adv, as_zero)

    # And the failed rollout contributes nothing to the loss, whatever its logprobs.
    config = GRPOConfig()
    logprobs = torch.randn(4, 5, requires_grad=True)
    behaviour = logprobs.detach() + 0.05 * torch.randn(4, 5)
    mask = torch.ones(4, 5)
    mask[2] = 0
    out = policy_loss(logprobs=logprobs, behaviour_logprobs=behaviour, advantages=adv, loss_mask=mask, config=config)
    out.loss.backward()
    assert torch.all(logprobs.grad[2] == 0)
    assert out.n_tokens == 15


def test_valid_rollout_with_nan_reward_is_rejected():
    with pytest.raises(ValueError, match="mark it invalid"):
        group_advantages(
            rewards=torch.tensor([float("nan"), 1.0]),
            valid=torch.tensor([True, True]),
            group_ids=torch.tensor([0, 0]),
        )


def test_lone_valid_rollout_has_no_baseline():
    adv = group_advantages(
        rewards=torch.tensor([1.0, 0.0]), valid=torch.tensor([True, False]), group_ids=torch.tensor([0, 0])
    )
    assert torch.equal(adv, torch.zeros(2))


def test_on_policy_gradient_equals_advantage_weighted_logprob_gradient():
    torch.manual_seed(0)
    logprobs = torch.randn(3, 4, requires_grad=True)
    advantages = torch.tensor([1.0, -0.5, 0.25])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    out = policy_loss(
        logprobs=logprobs,
        behaviour_logprobs=logprobs.detach(),
        advantages=advantages,
        loss_mask=mask,
        config=GRPOConfig(),
    )
    out.loss.backward()
    # ratio = 1 everywhere -> d loss / d logp = -A * mask / n_tokens (token-level normalisation)
    expected = -advantages.unsqueeze(1) * mask / mask.sum()
    assert torch.allclose(logprobs.grad, expected)
    assert out.clip_fraction == 0.0 and out.mean_ratio == pytest.approx(1.0)


def test_ratio_is_clipped_against_behaviour_policy():
    config = GRPOConfig(clip_low=0.2, clip_high=0.28, dual_clip=None)
    behaviour = torch.zeros(2, 1)
    # Token 0: ratio e^0.5 > 1.28 with positive advantage -> clipped, no gradient.
    # Token 1: ratio e^-0.5 < 0.8 with positive advantage -> unclipped (min picks the smaller).
    logprobs = torch.tensor([[0.5], [-0.5]], requires_grad=True)
    out = policy_loss(
        logprobs=logprobs,
        behaviour_logprobs=behaviour,
        advantages=torch.tensor([1.0, 1.0]),
        loss_mask=torch.ones(2, 1),
        config=config,
    )
    out.loss.backward()
    assert logprobs.grad[0, 0] == 0
    assert logprobs.grad[1, 0] == pytest.approx(-math.exp(-0.5) / 2)
    assert out.clip_fraction == pytest.approx(0.5)
    expected_loss = -(1.28 + math.exp(-0.5)) / 2
    assert out.loss.item() == pytest.approx(expected_loss, rel=1e-6)


def test_dual_clip_caps_negative_advantage_loss():
    logprobs = torch.tensor([[3.0]], requires_grad=True)  # ratio e^3 ~ 20 on a negative-advantage token
    kwargs = {"behaviour_logprobs": torch.zeros(1, 1), "advantages": torch.tensor([-1.0]), "loss_mask": torch.ones(1, 1)}
    capped = policy_loss(logprobs=logprobs, config=GRPOConfig(dual_clip=3.0), **kwargs)
    assert capped.loss.item() == pytest.approx(3.0)
    uncapped = policy_loss(logprobs=logprobs, config=GRPOConfig(dual_clip=None), **kwargs)
    assert uncapped.loss.item() == pytest.approx(math.exp(3.0), rel=1e-5)


def test_token_level_normalisation_weights_every_token_equally():
    logprobs = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    kwargs = {"behaviour_logprobs": torch.zeros(2, 4), "advantages": torch.tensor([1.0, 1.0]), "loss_mask": mask}
    token = policy_loss(logprobs=logprobs, config=GRPOConfig(normalization="token"), **kwargs)
    token.loss.backward()
    assert torch.allclose(logprobs.grad[mask.bool()], torch.full((5,), -1 / 5))
    logprobs.grad = None
    sequence = policy_loss(logprobs=logprobs, config=GRPOConfig(normalization="sequence"), **kwargs)
    sequence.loss.backward()
    assert logprobs.grad[0, 0].item() == pytest.approx(-1 / 2)
    assert logprobs.grad[1, 0].item() == pytest.approx(-1 / 8)


def test_micro_batches_with_shared_normalizer_equal_full_batch():
    torch.manual_seed(1)
    logprobs = torch.randn(4, 6, requires_grad=True)
    behaviour = logprobs.detach() + 0.1 * torch.randn(4, 6)
    adv = torch.randn(4)
    mask = (torch.rand(4, 6) > 0.3).float()
    config = GRPOConfig()
    full = policy_loss(logprobs=logprobs, behaviour_logprobs=behaviour, advantages=adv, loss_mask=mask, config=config)
    total = mask.sum().item()
    parts = sum(
        policy_loss(
            logprobs=logprobs[rows],
            behaviour_logprobs=behaviour[rows],
            advantages=adv[rows],
            loss_mask=mask[rows],
            config=config,
            token_normalizer=total,
        ).loss
        for rows in (slice(0, 2), slice(2, 4))
    )
    assert torch.allclose(full.loss, parts, atol=1e-6)


def test_padding_with_nan_behaviour_logprobs_is_harmless():
    logprobs = torch.zeros(1, 3, requires_grad=True)
    behaviour = torch.tensor([[0.0, float("nan"), float("-inf")]])
    out = policy_loss(
        logprobs=logprobs,
        behaviour_logprobs=behaviour,
        advantages=torch.tensor([1.0]),
        loss_mask=torch.tensor([[1.0, 0.0, 0.0]]),
        config=GRPOConfig(),
    )
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logprobs.grad).all()


def test_segments_share_their_rollout_advantage():
    rollout_adv = torch.tensor([0.5, -0.5])
    seg = segment_advantages(rollout_advantages=rollout_adv, segment_rollout=torch.tensor([0, 0, 0, 1]))
    assert torch.equal(seg, torch.tensor([0.5, 0.5, 0.5, -0.5]))
    with pytest.raises(ValueError, match="outside"):
        segment_advantages(rollout_advantages=rollout_adv, segment_rollout=torch.tensor([2]))


def test_length_penalty_is_concave_and_harsher_on_easy_problems():
    config = LengthPenaltyConfig(coef=0.3, length_scale=100, reference_length=1000, easiness_power=2)
    lengths = torch.tensor([0.0, 100.0, 200.0, 1000.0, 2000.0])
    easy = length_penalty(lengths=lengths, group_success_rate=torch.tensor(1.0), config=config)
    hard = length_penalty(lengths=lengths, group_success_rate=torch.tensor(0.25), config=config)
    assert easy[0] == 0 and easy[3] == pytest.approx(0.3)
    assert torch.allclose(hard, easy * 0.25**2)
    # Marginal cost per token shrinks as the answer grows (the first 100 tokens cost more than the next 100).
    assert (easy[1] - easy[0]) > (easy[2] - easy[1]) > 0
    assert easy[4] > easy[3]


def test_shaped_rewards_only_penalise_successes_and_keep_them_above_failures():
    config = LengthPenaltyConfig(coef=0.5, length_scale=10, reference_length=100)
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, float("nan")])
    valid = torch.tensor([True, True, True, True, False])
    groups = torch.tensor([0, 0, 0, 1, 0])
    lengths = torch.tensor([10.0, 100.0, 100.0, 100.0, 50.0])
    shaped = shaped_rewards(rewards=rewards, valid=valid, group_ids=groups, lengths=lengths, config=config)
    assert shaped[2] == 0.0  # failures are not penalised
    assert shaped[0] > shaped[1] > shaped[2]  # shorter correct answer wins; correct beats wrong
    # Group 1 is solved by all its rollouts (p=1), group 0 by 2 of 3 valid ones (p=2/3).
    assert shaped[3] == pytest.approx(0.5)
    assert shaped[1] == pytest.approx(1 - 0.5 * (2 / 3) ** 2)
    assert math.isnan(shaped[4])


def test_config_errors_say_how_to_fix():
    with pytest.raises(GRPOConfigError, match="Lower coef"):
        LengthPenaltyConfig(coef=1.0)
    with pytest.raises(GRPOConfigError, match="dual_clip"):
        GRPOConfig(dual_clip=1.1)
    with pytest.raises(GRPOConfigError, match="clip_low"):
        GRPOConfig(clip_low=1.5)
    assert GRPOConfig(length_penalty={"coef": 0.1}).length_penalty.coef == 0.1


def test_token_logprobs_matches_log_softmax():
    logits = torch.randn(2, 3, 11)
    targets = torch.randint(0, 11, (2, 3))
    expected = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, targets), expected, atol=1e-6)


def test_negative_advantage_weight_keeps_only_rollouts_that_beat_their_group():
    from training.train.rl import rollout_advantages
    from training.train.rollouts import RolloutRecord

    def record(group: int, reward: float | None, valid: bool = True) -> RolloutRecord:
        return RolloutRecord(task_id=f"t{group}", group=group, valid=valid, reward=reward, passed=reward == 1.0)

    records = [record(0, 1.0), record(0, 0.0), record(0, 0.0), record(0, 0.0), record(1, 0.0), record(1, None, False)]
    grpo = rollout_advantages(records, GRPOConfig())
    assert torch.allclose(grpo, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0]))
    filtered = rollout_advantages(records, GRPOConfig(negative_advantage_weight=0.0))
    assert torch.allclose(filtered, torch.tensor([0.75, 0.0, 0.0, 0.0, 0.0, 0.0]))
    assert not torch.signbit(filtered).any()  # -0.0 would leak into the rollout logs
    halved = rollout_advantages(records, GRPOConfig(negative_advantage_weight=0.5))
    assert torch.allclose(halved, torch.tensor([0.75, -0.125, -0.125, -0.125, 0.0, 0.0]))


@pytest.mark.parametrize("weight", [-0.1, 1.5])
def test_negative_advantage_weight_outside_unit_interval_is_refused(weight):
    with pytest.raises(GRPOConfigError, match="negative_advantage_weight"):
        GRPOConfig(negative_advantage_weight=weight)


def test_entropy_term_is_off_by_default_and_signed_by_its_coefficient():
    # Two positions with equal advantage-free surrogates (advantage 0): only the entropy term moves them.
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.5, 0.4, 0.3]]], requires_grad=True)
    log_probs = torch.log_softmax(logits, dim=-1)
    entropies = -(log_probs.exp() * log_probs).sum(-1)
    logprobs = log_probs[..., 0]
    kwargs = dict(
        behaviour_logprobs=logprobs.detach(), advantages=torch.tensor([0.0]), loss_mask=torch.ones(1, 2),
    )
    plain = policy_loss(logprobs=logprobs, config=GRPOConfig(), entropies=entropies, **kwargs)
    assert plain.loss.item() == 0.0
    assert plain.entropy == pytest.approx(entropies.mean().item())

    sharpen = policy_loss(logprobs=logprobs, config=GRPOConfig(entropy_coef=-0.01), entropies=entropies, **kwargs)
    assert sharpen.loss.item() == pytest.approx(0.01 * entropies.mean().item())
    sharpen.loss.backward()
    # Descending the loss lowers the entropy: a small step against the gradient makes the policy sharper.
    with torch.no_grad():
        stepped = logits - 10.0 * logits.grad
        stepped_log_probs = torch.log_softmax(stepped, dim=-1)
        stepped_entropy = -(stepped_log_probs.exp() * stepped_log_probs).sum(-1)
    assert torch.all(stepped_entropy < entropies.detach())

    bonus = policy_loss(logprobs=logprobs, config=GRPOConfig(entropy_coef=0.01), entropies=entropies, **kwargs)
    assert bonus.loss.item() == pytest.approx(-0.01 * entropies.mean().item())


def test_entropy_term_needs_entropies_and_a_bounded_coefficient():
    logprobs = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="no entropies were given"):
        policy_loss(logprobs=logprobs, behaviour_logprobs=logprobs, advantages=torch.tensor([1.0]),
                    loss_mask=torch.ones(1, 2), config=GRPOConfig(entropy_coef=-0.01))
    with pytest.raises(GRPOConfigError, match="entropy_coef=1.5 must lie in"):
        GRPOConfig(entropy_coef=1.5)


def test_positive_entropy_scope_sharpens_only_rollouts_that_beat_their_group():
    entropies = torch.tensor([[0.5, 0.2], [0.4, 0.3]], requires_grad=True)
    logprobs = torch.zeros(2, 2)
    kwargs = dict(
        logprobs=logprobs, behaviour_logprobs=logprobs, advantages=torch.tensor([0.5, -0.5]),
        loss_mask=torch.ones(2, 2), entropies=entropies,
    )
    without = policy_loss(config=GRPOConfig(), **kwargs).loss
    everywhere = policy_loss(config=GRPOConfig(entropy_coef=-0.1), **kwargs).loss
    positive = policy_loss(config=GRPOConfig(entropy_coef=-0.1, entropy_scope="positive"), **kwargs)
    assert (everywhere - without).item() == pytest.approx(0.1 * (0.5 + 0.2 + 0.4 + 0.3) / 4)
    assert (positive.loss - without).item() == pytest.approx(0.1 * (0.5 + 0.2) / 4)
    positive.loss.backward()
    assert torch.all(entropies.grad[1] == 0) and torch.all(entropies.grad[0] > 0)
    with pytest.raises(GRPOConfigError, match="entropy_scope='wrong'; use 'all'"):
        GRPOConfig(entropy_scope="wrong")


def test_kl_penalty_is_zero_at_the_reference_and_pulls_the_policy_back_to_it():
    # Advantage 0, so only the KL term acts; the policy has moved token 0 up from the reference's 0.5.
    reference_logits = torch.tensor([[[0.0, 0.0], [0.0, 0.0]]])
    logits = torch.tensor([[[1.5, 0.0], [0.0, 0.0]]], requires_grad=True)
    logprobs = torch.log_softmax(logits, dim=-1)[..., 0]
    reference_logprobs = torch.log_softmax(reference_logits, dim=-1)[..., 0]
    kwargs = dict(behaviour_logprobs=logprobs.detach(), advantages=torch.tensor([0.0]), loss_mask=torch.ones(1, 2))

    off = policy_loss(logprobs=logprobs, config=GRPOConfig(), reference_logprobs=reference_logprobs, **kwargs)
    assert off.loss.item() == 0.0
    gap = (reference_logprobs - logprobs).detach()
    k3 = (gap.exp() - gap - 1)
    assert off.kl_to_reference == pytest.approx(k3.mean().item())
    assert k3[0, 0] > 0 and k3[0, 1] == 0  # non-negative, and zero where the policy equals the reference

    penalised = policy_loss(logprobs=logprobs, config=GRPOConfig(kl_coef=0.1), reference_logprobs=reference_logprobs,
                            **kwargs)
    assert penalised.loss.item() == pytest.approx(0.1 * k3.mean().item())
    penalised.loss.backward()
    # Descending the loss lowers the token the policy had pushed above the reference.
    assert logits.grad[0, 0, 0] > 0 and logits.grad[0, 1].abs().max() == 0


def test_kl_penalty_needs_reference_logprobs_and_a_bounded_coefficient():
    logprobs = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="no reference_logprobs were given"):
        policy_loss(logprobs=logprobs, behaviour_logprobs=logprobs, advantages=torch.tensor([1.0]),
                    loss_mask=torch.ones(1, 2), config=GRPOConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match=r"reference_logprobs \(1, 3\) must be"):
        policy_loss(logprobs=logprobs, behaviour_logprobs=logprobs, advantages=torch.tensor([1.0]),
                    loss_mask=torch.ones(1, 2), config=GRPOConfig(kl_coef=0.1), reference_logprobs=torch.zeros(1, 3))
    for bad in (-0.1, 1.0):
        with pytest.raises(GRPOConfigError, match=f"kl_coef={bad} must lie in"):
            GRPOConfig(kl_coef=bad)


def test_kl_penalty_ignores_padding_with_infinite_reference_logprobs():
    logprobs = torch.tensor([[-0.5, 0.0]], requires_grad=True)
    reference_logprobs = torch.tensor([[-0.7, float("-inf")]])
    out = policy_loss(logprobs=logprobs, behaviour_logprobs=logprobs.detach(), advantages=torch.tensor([0.0]),
                      loss_mask=torch.tensor([[1.0, 0.0]]), config=GRPOConfig(kl_coef=0.2),
                      reference_logprobs=reference_logprobs)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.all(torch.isfinite(logprobs.grad)) and logprobs.grad[0, 1] == 0
