"""Training rows of RL rollouts and the learner's logprobs over them (the GRPO update's inputs).

- ``segments_to_batches``: every model call of every valid rollout with a nonzero advantage as a padded row
  (consecutive turns of one conversation merged into one row), in micro-batches of ``TrainingSegments``;
- ``segment_logprobs`` / ``segment_logprobs_and_entropy``: the sampled tokens' logprobs under the learner,
  at the rollout temperature, honouring the copy constraint's masks and (optionally) replayed routing;
- ``shared_prefix_groups`` / ``suffix_batch``: one-row batches that begin with the same tokens (a group's
  rollouts), so the update runs their common prefix once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from training.engine import SamplingMasks
from training.model.transformer import MoETransformer, SharedPrefix
from training.train.rollouts import RolloutRecord


@dataclass
class TrainingSegments:
    """Padded tensors of the segments of one micro-batch."""

    input_ids: torch.Tensor
    """int64 [B, T]."""

    targets: torch.Tensor
    """int64 [B, T] next tokens (pad where no loss)."""

    loss_mask: torch.Tensor
    """float [B, T]: 1 on sampled completion tokens of valid rollouts."""

    behaviour_logprobs: torch.Tensor
    """float [B, T] logprobs recorded at rollout time (0 where masked)."""

    advantages: torch.Tensor
    """float [B] the advantage of each segment's rollout."""

    routed_experts: torch.Tensor | None
    """int64 [B, T, n_layers, top_k] recorded routing (None without replay or for dense models)."""

    masked_positions: torch.Tensor | None = None
    """int64 [M, 2] (row, position) of the loss positions whose token was drawn under a constraint's mask;
    None when no token of the micro-batch was."""

    masked_allowed: torch.Tensor | None = None
    """bool [M, vocab]: the tokens each of those positions could draw; the learner's logprobs there are
    taken over these tokens only, as the behaviour policy's were."""


def segments_to_device(batch: TrainingSegments, device: torch.device) -> TrainingSegments:
    """The micro-batch with every tensor on `device` (the learner's, when it is not the CPU)."""
    moved = {
        item.name: None if getattr(batch, item.name) is None else getattr(batch, item.name).to(device)
        for item in dataclasses.fields(batch)
    }
    return TrainingSegments(**moved)


def segments_to_batches(
    *,
    records: list[RolloutRecord],
    advantages: torch.Tensor,
    micro_batch_size: int,
    pad_id: int,
    with_routing: bool,
    merge_turns: bool = True,
) -> list[TrainingSegments]:
    """Every model call of every valid rollout with a nonzero advantage as a training row.

    Invalid rollouts contribute nothing. Rollouts with zero advantage (a group whose rollouts all
    scored the same) carry no gradient; leaving them out keeps them from diluting the token-level
    normaliser, as DAPO's dynamic sampling does (without its over-sampling to refill the batch).

    merge_turns: a call whose prompt begins with an earlier call's prompt and completion (the next turn
    of the conversation, when the history re-renders to the same tokens) shares one row with it, with
    both completions in the loss. Causal attention gives every token the same logprob as in its own
    row, so the loss is unchanged under token-level normalisation, and the common prefix is computed
    once instead of once per turn (it is most of each row). Leave it off for per-sequence normalisation.
    """
    rows: list[tuple[_Row, float]] = []
    for record, advantage in zip(records, advantages.tolist(), strict=True):
        if not record.valid or advantage == 0.0:
            continue
        segments = [segment for segment in record.segments if segment.token_ids]
        rows.extend((row, advantage) for row in _segment_rows(segments, merge=merge_turns))
    batches = []
    for start in range(0, len(rows), micro_batch_size):
        chunk = rows[start : start + micro_batch_size]
        length = max(len(row.tokens) - 1 for row, _ in chunk)
        size = len(chunk)
        input_ids = torch.full((size, length), pad_id, dtype=torch.long)
        targets = torch.full((size, length), pad_id, dtype=torch.long)
        loss_mask = torch.zeros(size, length)
        behaviour = torch.zeros(size, length)
        routing = None
        masked_positions: list[tuple[int, int]] = []
        masked_allowed: list[torch.Tensor] = []
        for index, (row, _) in enumerate(chunk):
            sequence = torch.tensor(row.tokens, dtype=torch.long)
            n = sequence.shape[0] - 1
            input_ids[index, :n] = sequence[:-1]
            targets[index, :n] = sequence[1:]
            for first, logprobs, masks in row.completions:
                loss_mask[index, first : first + len(logprobs)] = 1.0
                behaviour[index, first : first + len(logprobs)] = torch.tensor(logprobs, dtype=torch.float32)
                if masks is not None:
                    masked_positions.extend((index, first + position) for position in masks.positions)
                    masked_allowed.append(masks.allowed)
            if with_routing and row.routing:
                for recorded in row.routing:
                    recorded = recorded.to(torch.long)
                    if routing is None:
                        routing = torch.zeros((size, length, *recorded.shape[1:]), dtype=torch.long)
                    routing[index, : recorded.shape[0]] = recorded
        batches.append(
            TrainingSegments(
                input_ids=input_ids, targets=targets, loss_mask=loss_mask, behaviour_logprobs=behaviour,
                advantages=torch.tensor([advantage for _, advantage in chunk], dtype=torch.float32),
                routed_experts=routing,
                masked_positions=torch.tensor(masked_positions, dtype=torch.long) if masked_positions else None,
                masked_allowed=torch.cat(masked_allowed) if masked_allowed else None,
            )
        )
    return batches


@dataclass
class _Row:
    tokens: list[int]
    """Prompt and completion of the row's last call."""
    completions: list[tuple[int, list[float], SamplingMasks | None]]
    """(input position of the first sampled token's prediction, behaviour logprobs, the constraint's masks)
    per merged call."""
    routing: list[torch.Tensor]
    """Recorded routing of the calls, the last call's first: written in this order, each earlier call's
    own rows overwrite the later call's copy of its span."""


def _segment_rows(segments: list, *, merge: bool) -> list[_Row]:
    rows: list[_Row] = []
    for segment in segments:
        tokens = segment.prompt_token_ids + segment.token_ids
        completion = (len(segment.prompt_token_ids) - 1, list(segment.logprobs), segment.sampling_masks)
        routing = [segment.routed_experts] if segment.routed_experts is not None else []
        previous = rows[-1] if rows else None
        if merge and previous is not None and segment.prompt_token_ids[: len(previous.tokens)] == previous.tokens:
            # the later call's routing first, then the earlier calls' own rows over their span
            rows[-1] = _Row(tokens, [*previous.completions, completion], routing + previous.routing)
        else:
            rows.append(_Row(tokens, [completion], routing))
    return rows


def segment_logprobs(
    model: MoETransformer, batch: TrainingSegments, *, temperature: float, routing_replay: bool
) -> torch.Tensor:
    """Logprobs of the batch's targets under `model`, at the rollout temperature.

    Only the loss positions (the sampled tokens) get logits; the rest of the [B, T] result is 0 and
    carries no gradient. The loss reads nothing else, and a rollout's row is mostly prompt and tool output.
    """
    return segment_logprobs_and_entropy(model, batch, temperature=temperature, routing_replay=routing_replay)[0]


def segment_logprobs_and_entropy(
    model: MoETransformer,
    batch: TrainingSegments,
    *,
    temperature: float,
    routing_replay: bool,
    prefix: SharedPrefix | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """segment_logprobs plus the policy's next-token entropy at the same positions ([B, T] each, 0 elsewhere).

    Both come from one log-softmax over the loss positions' logits, so the entropy costs a product and a
    sum over the vocabulary. prefix: the batch holds the rows after this shared prefix (suffix_batch).
    """
    mask = batch.loss_mask.bool()
    output = model(
        batch.input_ids,
        routing_override=batch.routed_experts if routing_replay else None,
        compute_router_losses=False,
        logits_mask=mask,
        prefix=prefix,
    )
    logits = output.logits.float() / temperature
    disallowed = None
    if batch.masked_positions is not None:
        # Tokens drawn under the copy constraint's mask: their logprobs (and entropies) are those of the masked
        # distribution, as the behaviour policy recorded them; a forced token (one allowed) carries no gradient.
        rows, positions = batch.masked_positions.unbind(1)
        if not bool(mask[rows, positions].all()):
            raise ValueError("masked_positions must be loss positions (sampled tokens).")
        loss_index = (mask.view(-1).long().cumsum(0) - 1).view(mask.shape)  # row of each loss position's logits
        disallowed = torch.zeros(logits.shape[-2:], dtype=torch.bool, device=logits.device)
        disallowed[loss_index[rows, positions]] = ~batch.masked_allowed.to(logits.device)
        disallowed = disallowed.view(logits.shape)
        logits = logits.masked_fill(disallowed, float("-inf"))
    log_probs = torch.log_softmax(logits, dim=-1)
    sampled = log_probs.gather(-1, batch.targets[mask].long().view(1, -1, 1)).view(-1)
    # a masked token's p log p is 0 * -inf: count it as 0 (and keep NaN out of the backward pass)
    finite = log_probs if disallowed is None else log_probs.masked_fill(disallowed, 0.0)
    entropy = -(log_probs.exp() * finite).sum(-1).view(-1)
    zeros = torch.zeros(mask.shape, dtype=sampled.dtype, device=sampled.device)
    return zeros.masked_scatter(mask, sampled), zeros.masked_scatter(mask, entropy)


SHARED_PREFIX_MIN_TOKENS = 64
"""Rows share a prefix in the learner only when it is at least this long: below it the saving is noise."""


def shared_prefix_groups(
    batches: list[TrainingSegments], *, routing_replay: bool, min_tokens: int = SHARED_PREFIX_MIN_TOKENS
) -> list[tuple[int, list[int]]]:
    """(prefix length, batch indices) of one-row batches that begin with the same tokens; length 0: the
    batch runs on its own. Groups come in the order of their first batch.

    A group's rollouts share the system prompt, the tool schemas and the task. The prefix ends before the
    first loss position of every member (its outputs are all keys, never logits), and with routing replay
    the members' recorded routing over it must agree too. Rollouts sampled by different policy versions
    route the prompt differently (one update of the toy policy moves some token's experts within the
    first ~60 positions) and finish in any order, so a batch joins the group it agrees with longest, not
    just the one before it; it starts a group of its own rather than cut an existing group's prefix short.
    """
    clusters: list[list] = []  # [shared length (the lead's first loss position while alone), members]
    singles: list[int] = []
    for index, batch in enumerate(batches):
        if batch.input_ids.shape[0] != 1 or not bool(batch.loss_mask.any()):
            singles.append(index)
            continue
        first_loss = int(batch.loss_mask[0].nonzero()[0, 0])
        best, best_common = None, 0
        for cluster in clusters:
            length, members = cluster
            lead = batches[members[0]]
            limit = min(first_loss, length)
            common = _common_prefix_length(lead.input_ids[0, :limit], batch.input_ids[0, :limit])
            if routing_replay and (lead.routed_experts is None) != (batch.routed_experts is None):
                common = 0
            elif routing_replay and lead.routed_experts is not None and common:
                common = _common_prefix_length(lead.routed_experts[0, :common], batch.routed_experts[0, :common])
            # A lone lead's length is only its first loss position; a formed group keeps most of its prefix.
            keeps_prefix = len(members) == 1 or common >= 0.9 * length
            if common >= min_tokens and keeps_prefix and common > best_common:
                best, best_common = cluster, common
        if best is None:
            clusters.append([first_loss, [index]])
        else:
            best[0] = best_common
            best[1].append(index)
    groups = [(length, members) if len(members) > 1 else (0, members) for length, members in clusters]
    groups += [(0, [index]) for index in singles]
    return sorted(groups, key=lambda group: group[1][0])


def _common_prefix_length(first: torch.Tensor, second: torch.Tensor) -> int:
    length = min(first.shape[0], second.shape[0])
    if length == 0:
        return 0
    differs = (first[:length] != second[:length]).reshape(length, -1).any(dim=1).nonzero()
    return int(differs[0, 0]) if differs.numel() else length


def suffix_batch(batch: TrainingSegments, prefix_length: int) -> TrainingSegments:
    """The batch's rows after their first prefix_length positions, for segment_logprobs_and_entropy(prefix=)."""
    masked_positions = batch.masked_positions
    if masked_positions is not None:
        masked_positions = masked_positions - torch.tensor([0, prefix_length], dtype=masked_positions.dtype)
    return TrainingSegments(
        input_ids=batch.input_ids[:, prefix_length:],
        targets=batch.targets[:, prefix_length:],
        loss_mask=batch.loss_mask[:, prefix_length:],
        behaviour_logprobs=batch.behaviour_logprobs[:, prefix_length:],
        advantages=batch.advantages,
        routed_experts=None if batch.routed_experts is None else batch.routed_experts[:, prefix_length:],
        masked_positions=masked_positions,
        masked_allowed=batch.masked_allowed,
    )
