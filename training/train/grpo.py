"""GRPO loss math: group-relative advantages, PPO-clip against the behaviour policy, length penalty.

Pure tensor functions with no I/O, so every rule of the RL objective is unit-testable on its own;
`training.train.rl` gathers rollouts and calls these.

The objective, per token t of rollout i in group g (one group = several rollouts of one task):

    A_i      = r_i - mean_{j in g, valid} r_j            (optionally / (std_{j in g, valid} r_j + eps))
    ratio_it = exp(logp_theta(y_it) - logp_behaviour(y_it))
    L_it     = -min(ratio_it * A_i, clip(ratio_it, 1 - clip_low, 1 + clip_high) * A_i) - entropy_coef * H_it
               + kl_coef * (exp(d_it) - d_it - 1),   d_it = logp_ref(y_it) - logp_theta(y_it)
    loss     = sum_{i,t} mask_it * L_it / sum_{i,t} mask_it          (token-level normalisation)

where H_it is the entropy of the current policy's next-token distribution at that position (at the
rollout temperature); entropy_coef defaults to 0, and entropy_scope="positive" keeps the term only on
rollouts with A_i > 0. The last term is the penalty to a frozen reference policy (the checkpoint the run
started from) with the GRPO paper's unbiased, non-negative "k3" estimator of KL(theta || ref) on the
sampled tokens; kl_coef defaults to 0.

How this differs from the GRPO paper (Shao et al., 2024, DeepSeekMath):
- the KL penalty to the reference model is off by default (as in DAPO / Dr. GRPO; the clip keeps each
  update local) and optional (kl_coef > 0, the paper's form) to keep a long run near its starting
  policy; the paper's reference is also the starting (SFT) policy;
- asymmetric "clip-higher" bounds (DAPO) so low-probability tokens can still be promoted;
- token-level normalisation over the whole batch instead of per-sequence means, so long rollouts
  are not down-weighted per token (DAPO); "sequence" normalisation is kept as an option;
- std-normalisation of advantages is optional and off by default (Dr. GRPO argues it biases
  towards easy/hard groups);
- optionally (negative_advantage_weight < 1) rollouts below their group's mean are down-weighted or,
  at 0, left out: the update then only reinforces what passed (RAFT / filtered behaviour cloning,
  with the group mean as baseline);
- an optional entropy term (entropy_coef): > 0 is the usual exploration bonus; < 0 is entropy
  minimisation (Agarwal et al., 2025, "The Unreasonable Effectiveness of Entropy Minimization"), which
  sharpens the policy towards its own modes on the tokens it sampled;
- rollouts that failed for infrastructure reasons (sandbox crash, timeouts of the machinery, not
  of the agent) carry no reward at all: they are masked out of the group statistics and the loss,
  never scored as zero;
- the ratio is taken against the logprobs recorded by the behaviour policy at rollout time, so
  rollouts produced by a slightly stale policy (asynchronous RL) are importance-corrected by the
  same clipped ratio; an optional dual-clip bound (Ye et al., 2020) caps the loss of negative-
  advantage tokens whose ratio exploded.

Length penalty (subtracted from the reward of successful rollouts only, so a correct answer always
beats a wrong one; see `LengthPenaltyConfig`):

    penalty(L, p) = coef * p**easiness_power * log(1 + L / length_scale) / log(1 + reference_length / length_scale)

where L is the rollout's completion length in tokens and p the fraction of valid rollouts of the
group that succeeded (p close to 1 = easy problem). The log makes the marginal cost of one more
token 1 / (length_scale + L): harsh on short answers, softer as thinking grows; the p**power factor
makes it harsh on easy problems and vanish on problems the group rarely solves. At
L = reference_length the penalty is exactly coef * p**power; it keeps growing (slowly) beyond that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from training.train.objective_options import EntropyScope, objective_options_problem

Normalization = Literal["token", "sequence"]


class GRPOConfigError(ValueError):
    """A GRPO/length-penalty config whose fields contradict each other; the message says how to fix it."""


@dataclass
class LengthPenaltyConfig:
    """Nonlinear length penalty applied to successful rollouts (formula in the module docstring)."""

    coef: float = 0.0
    """Penalty at reference_length on a problem every rollout solved; 0 disables the penalty."""

    length_scale: float = 256.0
    """Tokens after which the marginal cost of a token has halved (L0 in the formula)."""

    reference_length: float = 4096.0
    """Completion length (tokens) at which an easy problem is charged exactly `coef`."""

    easiness_power: float = 2.0
    """Exponent on the group success rate; larger values spare problems that are not trivially easy."""

    success_threshold: float = 0.5
    """A rollout whose reward exceeds this counts as successful (gets penalised, counts towards p)."""

    success_margin: float = 1.0
    """Reward gap between a successful and a failed rollout; coef must stay below it."""

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise GRPOConfigError(f"length penalty coef={self.coef} must be >= 0 (0 disables it).")
        if self.length_scale <= 0 or self.reference_length <= 0:
            raise GRPOConfigError("length_scale and reference_length must be positive token counts.")
        if self.easiness_power < 0:
            raise GRPOConfigError(f"easiness_power={self.easiness_power} must be >= 0.")
        if self.coef >= self.success_margin:
            raise GRPOConfigError(
                f"length penalty coef={self.coef} >= success_margin={self.success_margin}: a long correct "
                "rollout could score below a wrong one. Lower coef below the reward gap between success "
                "and failure."
            )


@dataclass
class GRPOConfig:
    """Group-relative policy optimisation with PPO clipping (see the module docstring)."""

    clip_low: float = 0.2
    """Lower clip: the ratio is clipped at 1 - clip_low for positive advantages."""

    clip_high: float = 0.28
    """Upper clip: the ratio is clipped at 1 + clip_high (clip-higher, DAPO)."""

    dual_clip: float | None = 3.0
    """Cap on the loss of negative-advantage tokens at dual_clip * |A| (None disables; must be > 1)."""

    normalize_advantage_std: bool = False
    """Divide group-centred advantages by the group's reward standard deviation."""

    advantage_eps: float = 1e-6
    """Added to the standard deviation before dividing (only with normalize_advantage_std)."""

    normalization: Normalization = "token"
    """"token": mean over all valid tokens of the batch; "sequence": mean of per-rollout token means."""

    length_penalty: LengthPenaltyConfig = field(default_factory=LengthPenaltyConfig)
    """Nonlinear length penalty on successful rollouts."""

    negative_advantage_weight: float = 1.0
    """Multiplier on negative advantages. 1 is GRPO. 0 trains only on rollouts that beat their group's
    mean (a RAFT-style filtered policy gradient): every update then only raises the likelihood of
    rollouts that passed, so the noise of pushing down failed rollouts (whose tokens are mostly the same
    as the successful ones') is gone. It tolerates a higher lr than GRPO before degrading,
    but collapses at high ones too (measurements in docs/notebook/). Values in between down-weight
    failures."""

    entropy_coef: float = 0.0
    """Weight of the mean token entropy subtracted from the loss. 0 leaves it out; > 0 rewards entropy
    (keeps the policy exploring); < 0 penalises it, sharpening sampled decoding towards the policy's
    modes. The entropy is concentrated on the few uncertain tokens of a rollout, so its mean is small and
    moving it takes weights of 0.1-0.5, comparable to a typical |advantage|."""

    entropy_scope: EntropyScope = "all"
    """Which trained rollouts the entropy term covers. "all": every one. "positive": only rollouts that beat
    their group's mean, so entropy minimisation sharpens the policy where its choices were right instead of
    also locking in the wrong ones."""

    kl_coef: float = 0.0
    """Weight of the per-token KL penalty to the reference policy (the run's starting checkpoint). 0 leaves it
    out and needs no reference model; > 0 pulls the policy back towards its start, meant to keep what the
    starting policy could already do, at the price of one more forward pass per update. GRPO (Shao et al.,
    2024) used 0.04."""

    def __post_init__(self) -> None:
        if isinstance(self.length_penalty, dict):
            self.length_penalty = LengthPenaltyConfig(**self.length_penalty)
        if not 0 <= self.clip_low < 1:
            raise GRPOConfigError(f"clip_low={self.clip_low} must be in [0, 1) so 1 - clip_low stays positive.")
        if self.clip_high < 0:
            raise GRPOConfigError(f"clip_high={self.clip_high} must be >= 0.")
        if self.dual_clip is not None and self.dual_clip <= 1 + self.clip_high:
            raise GRPOConfigError(
                f"dual_clip={self.dual_clip} must exceed 1 + clip_high={1 + self.clip_high}, otherwise it "
                "clips inside the PPO trust region; raise it (3.0 is usual) or set it to None."
            )
        if self.normalization not in ("token", "sequence"):
            raise GRPOConfigError(f"normalization={self.normalization!r}; use 'token' or 'sequence'.")
        if self.advantage_eps <= 0:
            raise GRPOConfigError("advantage_eps must be positive.")
        problem = objective_options_problem(
            negative_advantage_weight=self.negative_advantage_weight,
            entropy_coef=self.entropy_coef,
            entropy_scope=self.entropy_scope,
            kl_coef=self.kl_coef,
        )
        if problem:
            raise GRPOConfigError(problem)


def length_penalty(
    *, lengths: torch.Tensor, group_success_rate: torch.Tensor, config: LengthPenaltyConfig
) -> torch.Tensor:
    """Penalty per rollout (formula in the module docstring); lengths and success rates broadcast."""
    lengths = lengths.to(torch.float64).clamp_min(0)
    scale = math.log1p(config.reference_length / config.length_scale)
    shape = torch.log1p(lengths / config.length_scale) / scale
    return (config.coef * group_success_rate.to(torch.float64) ** config.easiness_power * shape).float()


def shaped_rewards(
    *,
    rewards: torch.Tensor,
    valid: torch.Tensor,
    group_ids: torch.Tensor,
    lengths: torch.Tensor,
    config: LengthPenaltyConfig,
) -> torch.Tensor:
    """Rewards after the length penalty; invalid (infrastructure-failed) rollouts are left untouched."""
    rewards = rewards.float()
    if config.coef == 0:
        return rewards.clone()
    valid = valid.bool()
    success = (rewards > config.success_threshold) & valid
    group_index = _dense_group_index(group_ids)
    n_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    valid_count = torch.zeros(n_groups).index_add_(0, group_index, valid.float())
    success_count = torch.zeros(n_groups).index_add_(0, group_index, success.float())
    success_rate = (success_count / valid_count.clamp_min(1))[group_index]
    penalty = length_penalty(lengths=lengths, group_success_rate=success_rate, config=config)
    return torch.where(success, rewards - penalty, rewards)


def group_advantages(
    *,
    rewards: torch.Tensor,
    valid: torch.Tensor,
    group_ids: torch.Tensor,
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantage per rollout relative to the valid rollouts of its group; invalid rollouts get 0.

    rewards: float [N] (values of invalid rollouts are ignored, NaN allowed); valid: bool [N], False
    for rollouts that failed for infrastructure reasons; group_ids: int [N], rollouts of one task
    share an id. A group with a single valid rollout has no baseline and yields advantage 0.
    """
    if not (rewards.shape == valid.shape == group_ids.shape) or rewards.dim() != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, valid {tuple(valid.shape)} and group_ids "
            f"{tuple(group_ids.shape)} must be 1-D tensors of the same length."
        )
    valid = valid.bool()
    clean = torch.where(valid, rewards.double(), torch.zeros((), dtype=torch.float64))
    if torch.isnan(clean).any():
        raise ValueError("A valid rollout has a NaN reward; mark it invalid instead of passing NaN.")
    group_index = _dense_group_index(group_ids)
    n_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    weight = valid.double()
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, weight)
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, clean * weight)
    mean = total / count.clamp_min(1)
    centred = clean - mean[group_index]
    if normalize_std:
        squared = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, centred.square() * weight)
        # Unbiased std as in the GRPO paper; groups with one valid rollout get advantage 0 anyway.
        std = (squared / (count - 1).clamp_min(1)).sqrt()
        centred = centred / (std[group_index] + eps)
    has_baseline = count[group_index] >= 2
    return torch.where(valid & has_baseline, centred, torch.zeros_like(centred)).float()


def segment_advantages(*, rollout_advantages: torch.Tensor, segment_rollout: torch.Tensor) -> torch.Tensor:
    """Advantage per training segment: every self-summarised segment of a rollout shares its advantage.

    A long rollout whose context was summarised is trained as several token sequences (segments);
    the reward exists only at the end of the rollout, so each segment receives the rollout's value.
    """
    if segment_rollout.numel() and (
        segment_rollout.min() < 0 or segment_rollout.max() >= rollout_advantages.shape[0]
    ):
        raise ValueError("segment_rollout holds a rollout index outside the rollout_advantages tensor.")
    return rollout_advantages[segment_rollout.long()]


@dataclass
class PolicyLossOutput:
    """The scalar loss plus the statistics logged every step."""

    loss: torch.Tensor
    """Scalar to backpropagate."""

    clip_fraction: float
    """Fraction of valid tokens where a clip bound was active (their gradient is zero)."""

    mean_ratio: float
    """Mean importance ratio over valid tokens (1.0 for perfectly on-policy data)."""

    approx_kl: float
    """Mean of (ratio - 1) - log(ratio) over valid tokens: a non-negative estimate of KL(behaviour||current)."""

    entropy: float | None
    """Mean entropy (nats) of the current policy over valid tokens; None when no entropies were given."""

    n_tokens: int
    """Valid tokens that contributed to the loss."""

    kl_to_reference: float | None = None
    """Mean k3 estimate of KL(current || reference) over valid tokens; None when no reference logprobs were given."""


def _policy_loss_inputs_check(
    *,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: GRPOConfig,
    entropies: torch.Tensor | None,
    reference_logprobs: torch.Tensor | None,
) -> None:
    """policy_loss's shape and option checks: a ValueError that says what to pass."""
    if logprobs.shape != behaviour_logprobs.shape or logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, behaviour_logprobs {tuple(behaviour_logprobs.shape)} and "
            f"loss_mask {tuple(loss_mask.shape)} must all be [batch, tokens]."
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [batch]={logprobs.shape[0]}, got {tuple(advantages.shape)}.")
    if entropies is not None and entropies.shape != logprobs.shape:
        raise ValueError(f"entropies {tuple(entropies.shape)} must be [batch, tokens] like logprobs.")
    if config.entropy_coef != 0 and entropies is None:
        raise ValueError("config.entropy_coef is not 0 but no entropies were given; pass the policy's entropies.")
    if reference_logprobs is not None and reference_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"reference_logprobs {tuple(reference_logprobs.shape)} must be [batch, tokens] like logprobs."
        )
    if config.kl_coef != 0 and reference_logprobs is None:
        raise ValueError(
            "config.kl_coef is not 0 but no reference_logprobs were given; pass the reference policy's logprobs "
            "of the sampled tokens."
        )


def policy_loss(
    *,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: GRPOConfig,
    token_normalizer: float | None = None,
    entropies: torch.Tensor | None = None,
    reference_logprobs: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Clipped surrogate loss.

    logprobs: [B, T] log-probabilities of the sampled tokens under the current policy (with grad);
    behaviour_logprobs: [B, T] the same tokens' logprobs recorded at rollout time; advantages: [B]
    one per sequence/segment; loss_mask: [B, T] 1 on assistant tokens of valid rollouts, 0 elsewhere
    (prompt, tool outputs, padding, infrastructure-failed rollouts). token_normalizer overrides the
    denominator of "token" normalisation (the valid-token count of the whole optimizer batch when it
    is split into micro-batches or across data-parallel ranks). entropies: [B, T] the current policy's
    next-token entropy at each position (with grad), required when config.entropy_coef is not 0.
    reference_logprobs: [B, T] the sampled tokens' logprobs under the reference policy (no grad),
    required when config.kl_coef is not 0.
    """
    _policy_loss_inputs_check(
        logprobs=logprobs, behaviour_logprobs=behaviour_logprobs, advantages=advantages, loss_mask=loss_mask,
        config=config, entropies=entropies, reference_logprobs=reference_logprobs,
    )
    mask = loss_mask.to(logprobs.dtype)
    # where() rather than multiplication: padding may hold NaN/inf behaviour logprobs.
    log_ratio = torch.where(loss_mask.bool(), logprobs - behaviour_logprobs.to(logprobs.dtype), 0.0)
    ratio = log_ratio.exp()
    adv = advantages.to(logprobs.dtype).unsqueeze(1)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - config.clip_low, 1 + config.clip_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    if config.dual_clip is not None:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, config.dual_clip * adv), surrogate)
    per_token = torch.where(loss_mask.bool(), -surrogate, 0.0)
    if config.entropy_coef != 0:
        entropy_mask = loss_mask.bool()
        if config.entropy_scope == "positive":
            entropy_mask = entropy_mask & (adv > 0)
        per_token = per_token - config.entropy_coef * torch.where(entropy_mask, entropies, 0.0)
    kl_per_token = None
    if reference_logprobs is not None:
        # k3 = r - log r - 1 with r = p_ref / p_theta: unbiased for KL(theta || ref) on tokens sampled from
        # theta and never negative. where() first: padding may hold NaN/inf reference logprobs, and a gap of 0
        # makes the term exactly 0 off the mask.
        ref_gap = torch.where(loss_mask.bool(), reference_logprobs.to(logprobs.dtype) - logprobs, 0.0)
        kl_per_token = ref_gap.exp() - ref_gap - 1
        if config.kl_coef != 0:
            per_token = per_token + config.kl_coef * kl_per_token

    n_tokens = int(mask.sum().item())
    if config.normalization == "token":
        denominator = token_normalizer if token_normalizer is not None else max(n_tokens, 1)
        loss = per_token.sum() / denominator
    else:
        per_sequence_tokens = mask.sum(dim=1)
        has_tokens = per_sequence_tokens > 0
        sequence_means = per_token.sum(dim=1) / per_sequence_tokens.clamp_min(1)
        denominator = token_normalizer if token_normalizer is not None else max(int(has_tokens.sum()), 1)
        loss = sequence_means[has_tokens].sum() / denominator

    return _policy_loss_output(
        loss=loss, mask=mask, n_tokens=n_tokens, ratio=ratio, log_ratio=log_ratio, surrogate=surrogate,
        unclipped=unclipped, entropies=entropies, kl_per_token=kl_per_token,
    )

def _policy_loss_output(
    *,
    loss: torch.Tensor,
    mask: torch.Tensor,
    n_tokens: int,
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    surrogate: torch.Tensor,
    unclipped: torch.Tensor,
    entropies: torch.Tensor | None,
    kl_per_token: torch.Tensor | None,
) -> PolicyLossOutput:
    """policy_loss's result: the loss and its statistics over the loss positions."""
    with torch.no_grad():
        valid = mask.bool()
        if n_tokens:
            selected_ratio = ratio[valid]
            # A token counts as clipped when the clipped branch won the min (its gradient is zero).
            was_clipped = (surrogate != unclipped)[valid]
            clip_fraction = was_clipped.float().mean().item()
            mean_ratio = selected_ratio.mean().item()
            approx_kl = ((selected_ratio - 1) - log_ratio[valid]).mean().item()
        else:
            clip_fraction, mean_ratio, approx_kl = 0.0, 1.0, 0.0
        mean_entropy = None
        if entropies is not None:
            mean_entropy = entropies[valid].mean().item() if n_tokens else 0.0
        kl_to_reference = None
        if kl_per_token is not None:
            kl_to_reference = kl_per_token[valid].mean().item() if n_tokens else 0.0
    return PolicyLossOutput(
        loss=loss, clip_fraction=clip_fraction, mean_ratio=mean_ratio, approx_kl=approx_kl,
        entropy=mean_entropy, n_tokens=n_tokens, kl_to_reference=kl_to_reference,
    )


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-probability of each target token: logits [B, T, V] float, targets [B, T] -> [B, T]."""
    return -torch.nn.functional.cross_entropy(
        logits.float().transpose(1, 2), targets.long(), reduction="none"
    )


def _dense_group_index(group_ids: torch.Tensor) -> torch.Tensor:
    if group_ids.numel() == 0:
        return group_ids.long()
    return torch.unique(group_ids, return_inverse=True)[1]
