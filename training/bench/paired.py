"""Paired comparisons of two held-out evaluations over the same tasks: pass@1 and pass@k differences
with paired bootstrap intervals, and an exact McNemar test of pass@k (solved by at least one attempt).

The unit is the task: both evaluations attempted the same held-out tasks, so each task gives one
paired difference and task difficulty, which both share, cancels out of the interval. Inputs are
``run_benchmark`` ``per_task`` rows ({"task_id", "attempts", "passes", ...}).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from training.bench.runner import BenchConfigError, _scored_task_pairs, pass_at_k


@dataclass
class PairedDifference:
    """One metric's difference B - A over the tasks both evaluations scored."""

    metric: str
    """"pass@1" or "pass@k" (k: the attempts per task of both evaluations)."""

    a: float
    """Mean of the metric for A over the paired tasks."""

    b: float
    """Mean of the metric for B over the paired tasks."""

    difference: float
    """b - a."""

    low: float
    """Lower end of the paired bootstrap interval of the difference."""

    high: float
    """Upper end of the paired bootstrap interval of the difference."""

    tasks: int
    """Tasks scored in both evaluations."""

    mcnemar_p: float | None = None
    """Exact two-sided McNemar p of pass@k (tasks solved by one side only); None for pass@1."""


def per_task_rates(before: list[dict], after: list[dict], *, k: int) -> list[tuple[float, float]]:
    """(A, B) pass@k of every task scored with at least k attempts in both, in ``after``'s order."""
    return [
        (pass_at_k(n=old["attempts"], c=old["passes"], k=k), pass_at_k(n=new["attempts"], c=new["passes"], k=k))
        for old, new in _scored_task_pairs(before, after)
        if old["attempts"] >= k and new["attempts"] >= k
    ]


def paired_bootstrap(
    pairs: list[tuple[float, float]], *, resamples: int = 10_000, seed: int = 0, confidence: float = 0.95
) -> tuple[float, float, float]:
    """(mean difference, low, high): the percentile interval of the mean of B - A over task resamples."""
    if len(pairs) < 2:
        raise BenchConfigError(f"a paired interval needs at least 2 tasks scored in both runs, got {len(pairs)}")
    if not 0 < confidence < 1 or resamples < 100:
        raise BenchConfigError("confidence must be in (0, 1) and resamples >= 100")
    differences = [b - a for a, b in pairs]
    n = len(differences)
    rng = random.Random(seed)
    means = sorted(sum(differences[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    tail = (1 - confidence) / 2
    low = means[int(math.floor(tail * (resamples - 1)))]
    high = means[int(math.ceil((1 - tail) * (resamples - 1)))]
    return sum(differences) / n, low, high


def mcnemar_exact(pairs: list[tuple[float, float]]) -> float:
    """Two-sided exact McNemar p of binary outcomes (1.0 = solved): the binomial test of the discordant tasks."""
    only_a = sum(1 for a, b in pairs if a >= 1 and b < 1)
    only_b = sum(1 for a, b in pairs if b >= 1 and a < 1)
    discordant = only_a + only_b
    if discordant == 0:
        return 1.0
    smaller = min(only_a, only_b)
    tail = sum(math.comb(discordant, i) for i in range(smaller + 1)) / 2**discordant
    return min(1.0, 2 * tail)


def paired_comparison(
    before: list[dict], after: list[dict], *, k: int, resamples: int = 10_000, seed: int = 0
) -> list[PairedDifference]:
    """pass@1 and pass@k of B (``after``) against A (``before``) with paired bootstrap intervals."""
    results = []
    for metric, order in (("pass@1", 1), (f"pass@{k}", k)):
        pairs = per_task_rates(before, after, k=order)
        difference, low, high = paired_bootstrap(pairs, resamples=resamples, seed=seed)
        results.append(
            PairedDifference(
                metric=metric,
                a=sum(a for a, _ in pairs) / len(pairs),
                b=sum(b for _, b in pairs) / len(pairs),
                difference=difference,
                low=low,
                high=high,
                tasks=len(pairs),
                mcnemar_p=mcnemar_exact(pairs) if order > 1 else None,
            )
        )
    return results
