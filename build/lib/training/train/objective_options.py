"""Checks of the policy-objective options that both the GRPO loss and the launch form configure.

Torch-free on purpose: `training.train.grpo.GRPOConfig` (which the learner builds) and
`training.rollout.config.AsyncRLConfig` (which the web process builds to validate a launch form,
and must not pay a torch import for) both call `objective_options_problem`, so the bounds and their
messages live in one place. Each message starts with the field name, which the launch form keys on.
"""

from __future__ import annotations

from typing import Literal, get_args

EntropyScope = Literal["all", "positive"]
ENTROPY_SCOPES: tuple[str, ...] = get_args(EntropyScope)


def objective_options_problem(
    *, negative_advantage_weight: float, entropy_coef: float, entropy_scope: str, kl_coef: float
) -> str | None:
    """The first thing wrong with these options, as a message that says how to fix it; None if they are valid."""
    if not 0 <= negative_advantage_weight <= 1:
        return (
            f"negative_advantage_weight={negative_advantage_weight} must lie in [0, 1]: 1 is GRPO, 0 keeps only "
            "rollouts better than their group's mean."
        )
    if not -1 < entropy_coef < 1:
        return (
            f"entropy_coef={entropy_coef} must lie in (-1, 1): 0 leaves the entropy term out, < 0 sharpens the "
            "policy, > 0 keeps it exploring; the rewards differ by at most 1, so a larger weight lets the entropy "
            "term alone decide the update (the learning runs in docs/notebook/ used -0.5 and 0.1)."
        )
    if entropy_scope not in ENTROPY_SCOPES:
        return (
            f"entropy_scope={entropy_scope!r}; use 'all' (every trained rollout) or 'positive' (only rollouts "
            "that beat their group)."
        )
    if not 0 <= kl_coef < 1:
        return (
            f"kl_coef={kl_coef} must lie in [0, 1): 0 leaves the penalty to the starting policy out; a positive "
            "weight pulls the policy back towards it. The penalty is per sampled token, so a weight of 1 or more "
            "would outweigh any advantage (rewards differ by at most 1); GRPO used 0.04."
        )
    return None
