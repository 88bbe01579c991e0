"""Token sampling for the generation engine: seeded inverse-CDF draws (with top-p) and top-k logprobs.

Each row draws one uniform number from its own generator, so a request's tokens depend only on its
seed and its logits, never on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MAX_TOP_LOGPROBS = 20
"""Most alternatives a request may ask for per token (OpenAI's limit for top_logprobs)."""


def step_logprobs(logits: torch.Tensor, temperatures: Sequence[float]) -> torch.Tensor:
    """log-softmax [B, V] of each row's logits at its temperature (greedy rows, temperature 0, unscaled):
    the distribution GenerationResult.logprobs and the top logprobs are reported under."""
    logits = logits.float().cpu()
    if not any(temperatures):
        return logits.log_softmax(dim=-1)
    scale = torch.tensor([temperature or 1.0 for temperature in temperatures], dtype=torch.float32)
    return (logits / scale[:, None]).log_softmax(dim=-1)


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """The k most likely (token id, logprob) of each row of log-probabilities [B, V], most likely first."""
    if k < 1:
        return [[] for _ in range(logprobs.shape[0])]
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1, sorted=True)
    return [list(zip(row_ids, row_values, strict=True)) for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)]


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of logits [B, V]; returns (tokens [B], logprobs [B]) on the CPU.

    Row b draws a single uniform number from generators[b] and inverts the CDF of its distribution,
    so its token depends only on its own logits and generator, never on the other rows.
    """
    logits = logits.float().cpu()
    if not any(temperatures):
        # all greedy (evaluation, benchmarks): no temperature scaling and no draws to make
        tokens = logits.argmax(dim=-1)
        return tokens, logits.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1)
    sampled_rows = [row for row, temperature in enumerate(temperatures) if temperature != 0]
    # greedy rows keep their raw logits (temperature 1)
    scale = torch.tensor([temperature or 1.0 for temperature in temperatures], dtype=torch.float32)
    logprobs_all = (logits / scale[:, None]).log_softmax(dim=-1)
    uniforms = torch.cat([torch.rand(1, generator=generators[row]) for row in sampled_rows])
    top_p = torch.tensor([top_ps[row] for row in sampled_rows], dtype=torch.float32)
    if len(sampled_rows) == len(temperatures):
        # every row sampled (RL rollouts): no argmax and no row gathers
        tokens = _inverse_cdf_sample(logprobs_all.exp(), top_p, uniforms)
    else:
        tokens = logits.argmax(dim=-1)
        tokens[sampled_rows] = _inverse_cdf_sample(logprobs_all[sampled_rows].exp(), top_p, uniforms)
    logprobs = logprobs_all.gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs


def _full_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Tokens [R] for probability rows [R, V] without truncation: the CDF in vocabulary order needs no sort."""
    cumulative = probs.cumsum(dim=-1)
    targets = uniforms[:, None] * cumulative[:, -1:]
    return torch.searchsorted(cumulative, targets, right=True).clamp_max(probs.shape[-1] - 1).squeeze(1)


def _inverse_cdf_sample(probs: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Tokens [R] for probability rows [R, V]; rows with top_p < 1 sample from their nucleus only."""
    full = top_p >= 1
    if bool(full.all()):
        return _full_cdf_sample(probs, uniforms)
    tokens = torch.empty(probs.shape[0], dtype=torch.long)
    if bool(full.any()):
        tokens[full] = _full_cdf_sample(probs[full], uniforms[full])
    nucleus = ~full
    if bool(nucleus.any()):
        rows, p = probs[nucleus], top_p[nucleus, None]
        vocab = rows.shape[-1]
        # Sorting the whole vocabulary is slow on CPU; the nucleus usually sits in the top few dozen
        # tokens, so widen a top-k window until it holds top_p of the mass in every row.
        width = min(64, vocab)
        while True:
            values, order = rows.topk(width, dim=-1)
            if width == vocab or bool((values.sum(dim=-1, keepdim=True) >= p).all()):
                break
            width = min(vocab, width * 4)
        # keep a token when the mass before it is below top_p (the most likely token is always kept)
        values = torch.where(values.cumsum(dim=-1) - values < p, values, torch.zeros_like(values))
        cumulative = values.cumsum(dim=-1)
        targets = uniforms[nucleus, None] * cumulative[:, -1:]
        positions = torch.searchsorted(cumulative, targets, right=True)
        # never land on a zero-probability tail entry because of rounding
        positions = torch.minimum(positions, (values > 0).sum(dim=-1, keepdim=True) - 1)
        tokens[nucleus] = order.gather(1, positions).squeeze(1)
    return tokens
