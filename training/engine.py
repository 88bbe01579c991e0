"""Generation engine: slot KV cache, continuous batching, seeded sampling, logprobs and routed experts.

Each step first admits waiting requests into free cache slots (prefill, which also samples their first
token), then decodes one token for every running sequence in a single batched forward pass. Finished
sequences free their slot at once, so new requests join without waiting for the batch to drain.

Sampling draws one uniform number per token from the request's own seeded generator and inverts the
(top-p truncated) CDF, so a request's tokens depend only on its seed and its logits, not on which other
requests share the batch.

Prefix cache (``EngineConfig.prefix_cache_size``): the keys and values of finished sequences are kept, and
a new prompt that starts with the same tokens as one of them copies that prefix into its slot and prefills
only the rest. An agent's requests share the system prompt with its tool schemas (~1.5k tokens), and each
turn of a conversation repeats the whole previous one, so on the CPU most of a prefill's cost (0.8 s for
2.6k tokens of the tiny model) is avoided. Entries are dropped as soon as any weight changes (an RL update),
since their keys and values were computed with the old weights; a hit changes logits only by rounding.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from training.model.fused_forward import FusedForward, fused_forward_supports
from training.model.kv_cache import KVCache
from training.model.transformer import MoETransformer
from training.model.weights_watch import WeightsWatch
from training.sampling import MAX_TOP_LOGPROBS, sample_tokens, step_logprobs, top_logprobs

__all__ = ["sample_tokens"]  # re-exported: callers and tests import it from here

FinishReason = Literal["stop", "length", "cancelled"]

FUSED_MAX_TOKENS = 16
"""Longest input the fused forward runs; longer prefills take MoETransformer.forward, whose attention
(scaled_dot_product_attention) is ~2.7x faster for a 2.6k-token prompt on the CPU (277 vs 756 ms, tiny
model, one thread), while the fused path wins at decoding (5.3 vs 6.7 ms per step of 4 sequences)."""


PREFILL_FORWARD_TOKENS = 32
"""What one more prefill forward costs, in padded prompt tokens, when _prefill_groups splits admitted
prompts by length (imported 8-expert models, CPU: a 1-row prefill costs ~4 ms plus ~0.1 ms a token; the
benchmark's decode throughput moved by under 1% between 16 and 128)."""


class TokenConstraint(Protocol):
    def allowed(self, generated: Sequence[int]) -> torch.Tensor | None:
        """Boolean mask [vocab] of the tokens allowed after `generated`, or None for no restriction."""


@dataclass
class SamplingParams:
    """How one request is sampled."""

    max_tokens: int = 256
    """Most tokens to generate (the stop token counts)."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""

    top_p: float = 1.0
    """Nucleus sampling: sample among the most likely tokens whose probabilities sum to top_p."""

    seed: int | None = None
    """Seed of this request's generator; the same seed and prompt give the same tokens. None: random."""

    stop_token_ids: tuple[int, ...] = ()
    """Generation ends right after any of these tokens (which is kept in the output)."""

    constraint: TokenConstraint | None = None
    """Masks the tokens that may come next (training.copy_constraint.CopyConstraint); None: any token.
    The recorded logprob is that of the masked distribution the token was drawn from, and the masks come
    back in GenerationResult.sampling_masks so that a learner can recompute it."""

    top_logprobs: int = 0
    """Also report this many most likely tokens (id, logprob) at every step, 0..MAX_TOP_LOGPROBS, under the
    same distribution as the sampled token's logprob (TokenEvent.top_logprobs, GenerationResult.top_logprobs)."""

    def __post_init__(self) -> None:
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


@dataclass
class EngineConfig:
    """Capacity of the engine."""

    max_batch_size: int = 8
    """Cache slots, i.e. sequences decoded together; more requests wait in a queue."""

    max_seq_len: int | None = None
    """Longest prompt + completion; None uses the model's max_seq_len (this sizes the KV cache)."""

    record_routing: bool = True
    """Keep the experts every token was routed to (for routing replay in RL)."""

    fused_forward: bool = True
    """Run the model through training.model.fused_forward (same results, far fewer operators per step);
    False runs MoETransformer.forward, the reference the fused path is tested and benchmarked against."""

    prefix_cache_size: int = 32
    """Finished sequences whose keys and values are kept for prompts that start the same way (least
    recently used first out; 0 disables). Each costs its tokens x n_layers x 2 x n_kv_heads x head_dim
    cache elements (about 3 MB for a 3k-token conversation of the tiny model)."""

    min_prefix_tokens: int = 32
    """Shortest cached prefix worth copying instead of recomputing."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}.")
        if self.prefix_cache_size < 0:
            raise ValueError(f"prefix_cache_size must be >= 0 (0 disables it), got {self.prefix_cache_size}.")
        if self.min_prefix_tokens < 1:
            raise ValueError(f"min_prefix_tokens must be >= 1, got {self.min_prefix_tokens}.")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}.")


@dataclass
class SamplingMasks:
    """The masks a TokenConstraint applied to one request: what a learner needs to recompute its logprobs."""

    positions: list[int]
    """Indices into GenerationResult.token_ids of the tokens drawn under a mask, ascending."""

    allowed: torch.Tensor
    """bool [len(positions), vocab]: the tokens each of those steps could draw."""


@dataclass
class GenerationResult:
    """A finished request."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    """Generated tokens, including the stop token when finish_reason is "stop"."""

    logprobs: list[float]
    """log p(token) under the temperature-scaled distribution before top-p truncation (raw for greedy),
    after the constraint's mask where one applied (see sampling_masks)."""

    finish_reason: FinishReason
    routed_experts: torch.Tensor | None
    """int16 [len(prompt) + len(tokens) - 1, n_layers, top_k]: experts used by every token that was fed to
    the model, i.e. exactly the routing of a training forward over (prompt + tokens)[:-1]."""

    sampling_masks: SamplingMasks | None = None
    """The constraint's masks, when SamplingParams.constraint masked any step; None otherwise."""

    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per generated token, the SamplingParams.top_logprobs most likely (token id, logprob), most likely
    first, under the distribution of `logprobs`; None when none were asked for."""


@dataclass
class TokenEvent:
    """One sampled token; `result` is set on the request's last token."""

    request_id: int
    token_id: int
    logprob: float
    result: GenerationResult | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    """The most likely (token id, logprob) at this step, when SamplingParams.top_logprobs asked for them."""


@dataclass
class _CachedPrefix:
    """Keys and values of a finished sequence's fed tokens, for prompts that begin with those tokens."""

    tokens: torch.Tensor
    """int64 [L]: the tokens whose keys and values are kept (prompt + generated, minus the last)."""
    keys: torch.Tensor
    """[n_layers, n_kv_heads, L, head_dim], in the cache's dtype."""
    values: torch.Tensor
    routing: torch.Tensor | None
    """int16 [L, n_layers, top_k] experts of each token, when routing is recorded."""


@dataclass
class _Sequence:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    slot: int = -1
    weights_stamp: tuple | None = None
    """Weights the sequence was admitted under; its keys and values are cached only if they still hold."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routing: list[torch.Tensor] = field(default_factory=list)
    mask_positions: list[int] = field(default_factory=list)
    mask_rows: list[torch.Tensor] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class GenerationEngine:
    """Continuous-batching sampler over a MoETransformer. Not thread-safe: serving drives it from one thread."""

    def __init__(self, model: MoETransformer, *, config: EngineConfig | None = None) -> None:
        self.model = model.eval()
        self.config = config or EngineConfig()
        self.max_seq_len = self.config.max_seq_len or model.config.max_seq_len
        device = next(model.parameters()).device
        self.device = device
        cache_dtype = torch.float32 if model.config.precision == "fp32" else torch.bfloat16
        self.cache = KVCache(
            model.config,
            max_batch_size=self.config.max_batch_size,
            max_seq_len=self.max_seq_len,
            dtype=cache_dtype,
            device=device,
        )
        self.record_routing = self.config.record_routing and model.config.is_moe
        fused = self.config.fused_forward and fused_forward_supports(model.config)
        self.fused_forward = FusedForward(model) if fused else None
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[int, _Sequence] = {}
        self._free_slots = list(range(self.config.max_batch_size))
        self._ids = itertools.count()
        self._prefixes: OrderedDict[int, _CachedPrefix] = OrderedDict()
        self._prefix_ids = itertools.count()
        self._prefix_stamp: tuple | None = None
        self._weights_watch = WeightsWatch(model)
        self.prefix_stats = {"lookups": 0, "hits": 0, "reused_tokens": 0, "prompt_tokens": 0}
        """Counters of the prefix cache: prompts admitted, prompts that reused a prefix, tokens reused
        and prompt tokens in all (reused_tokens / prompt_tokens is the share of prefill avoided)."""

    # ----------------------------------------------------------------- requests
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a prompt; returns its request id."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("The prompt is empty; give at least one token.")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"Prompt token ids must be in [0, {vocab}).")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(
                f"Prompt of {len(prompt)} tokens leaves no room to generate within max_seq_len="
                f"{self.max_seq_len}; shorten the prompt or raise EngineConfig.max_seq_len."
            )
        generator = torch.Generator(device="cpu")
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        request_id = next(self._ids)
        self._waiting.append(_Sequence(request_id, prompt, params, generator))
        return request_id

    def cancel(self, request_id: int) -> bool:
        """Drop a waiting or running request; returns False if it is unknown or already finished."""
        for sequence in self._waiting:
            if sequence.request_id == request_id:
                self._waiting.remove(sequence)
                return True
        for slot, sequence in list(self._running.items()):
            if sequence.request_id == request_id:
                self._release(slot)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Run prompts to completion (continuous batching over max_batch_size slots); results in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"Got {len(prompts)} prompts but {len(params)} SamplingParams.")
        ids = [self.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        results: dict[int, GenerationResult] = {}
        while len(results) < len(ids):
            for event in self.step():
                if event.result is not None:
                    results[event.request_id] = event.result
        return [results[request_id] for request_id in ids]

    # --------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """Admit waiting requests, then decode one token for every running sequence."""
        events: list[TokenEvent] = []
        admitted = []
        while self._waiting and self._free_slots:
            sequence = self._waiting.popleft()
            sequence.slot = self._free_slots.pop(0)
            self._running[sequence.slot] = sequence
            admitted.append(sequence)
        if admitted:
            events.extend(self._prefill(admitted))
        if self._running:
            events.extend(self._decode())
        return events

    def _prefill(self, sequences: list[_Sequence]) -> list[TokenEvent]:
        """Forwards over the right-padded prompts of the newly admitted sequences (after any prefix found
        in the prefix cache, which is copied into the slot instead), grouped by _prefill_groups."""
        reused = self._reuse_prefixes(sequences)
        events: list[TokenEvent] = []
        for group in self._prefill_groups(list(zip(sequences, reused, strict=True))):
            events.extend(self._prefill_rows(group))
        return events

    def _prefill_groups(self, rows: list[tuple[_Sequence, int]]) -> list[list[tuple[_Sequence, int]]]:
        """Rows (sequence, reused prefix length) split into prefill forwards: sorted by their new tokens and
        cut where that costs least, counting each forward's padded tokens plus PREFILL_FORWARD_TOKENS.

        Every row of a forward is padded to its longest: 8 prompts of 16-93 tokens are 744 tokens in one
        forward but 473 in three. A row that starts deep into a cached prefix and a long fresh prompt could
        reach past the cache together, so no group holds rows that would.
        """
        ordered = sorted(rows, key=lambda row: len(row[0].prompt) - row[1])
        new_tokens = [len(sequence.prompt) - start for sequence, start in ordered]
        # cost[end]: cheapest split of ordered[:end]; first[end]: where its last group starts
        cost, first = [0] + [float("inf")] * len(ordered), [0] * (len(ordered) + 1)
        for end in range(1, len(ordered) + 1):
            deepest = 0
            for start in range(end - 1, -1, -1):
                deepest = max(deepest, ordered[start][1])
                if start < end - 1 and deepest + new_tokens[end - 1] > self.max_seq_len:
                    break  # a longer group holds the same rows
                candidate = cost[start] + PREFILL_FORWARD_TOKENS + (end - start) * new_tokens[end - 1]
                if candidate < cost[end]:
                    cost[end], first[end] = candidate, start
        groups, end = [], len(ordered)
        while end:
            groups.append(ordered[first[end] : end])
            end = first[end]
        return groups[::-1]

    def _prefill_rows(self, rows: list[tuple[_Sequence, int]]) -> list[TokenEvent]:
        sequences = [sequence for sequence, _ in rows]
        reused = [start for _, start in rows]
        prompt_lengths = [len(s.prompt) for s in sequences]
        suffixes = [s.prompt[start:] for s, start in rows]
        longest = max(len(suffix) for suffix in suffixes)
        input_ids = torch.tensor([suffix + [0] * (longest - len(suffix)) for suffix in suffixes], device=self.device)
        slots = [s.slot for s in sequences]
        logits, routed = self._forward(input_ids, slots, reused, [len(suffix) - 1 for suffix in suffixes])
        # Padding wrote keys past each prompt; they sit beyond the slot's length, so attention masks
        # them until decoding overwrites them.
        self.cache.lengths[torch.tensor(slots, device=self.device)] = torch.tensor(
            prompt_lengths, device=self.device
        )
        if routed is not None:
            for sequence, routes, suffix in zip(sequences, routed.unbind(0), suffixes, strict=True):
                sequence.routing.append(routes[: len(suffix)])
        return self._sample_and_advance(sequences, logits)

    # ----------------------------------------------------------- prefix cache
    def _reuse_prefixes(self, sequences: list[_Sequence]) -> list[int]:
        """Copy the longest cached prefix of each prompt into its slot; returns the reused lengths."""
        if not self.config.prefix_cache_size:
            return [0] * len(sequences)
        stamp = self._weights_watch.stamp()
        if stamp != self._prefix_stamp:
            self._prefixes.clear()
            self._prefix_stamp = stamp
        reused = []
        for sequence in sequences:
            sequence.weights_stamp = stamp
            key, length = self._longest_cached_prefix(sequence.prompt)
            self.prefix_stats["lookups"] += 1
            self.prefix_stats["prompt_tokens"] += len(sequence.prompt)
            if key is None:
                reused.append(0)
                continue
            entry = self._prefixes[key]
            self._prefixes.move_to_end(key)
            self.cache.key_storage[:, sequence.slot, :, :length] = entry.keys[:, :, :length]
            self.cache.value_storage[:, sequence.slot, :, :length] = entry.values[:, :, :length]
            # the unfused forward reads the start of each row from the cache's lengths
            self.cache.lengths[sequence.slot] = length
            if entry.routing is not None and self.record_routing:
                sequence.routing.append(entry.routing[:length])
            self.prefix_stats["hits"] += 1
            self.prefix_stats["reused_tokens"] += length
            reused.append(length)
        return reused

    def _longest_cached_prefix(self, prompt: list[int]) -> tuple[int | None, int]:
        # at least the prompt's last token is fed again: its logits sample the first new token
        limit = len(prompt) - 1
        if limit < self.config.min_prefix_tokens or not self._prefixes:
            return None, 0
        prompt_ids = torch.tensor(prompt[:limit])
        best_key, best_length = None, self.config.min_prefix_tokens - 1
        for key, entry in self._prefixes.items():
            common = min(limit, entry.tokens.numel())
            if common <= best_length:
                continue
            mismatches = (entry.tokens[:common] != prompt_ids[:common]).nonzero()
            length = common if mismatches.numel() == 0 else int(mismatches[0])
            if length > best_length:
                best_key, best_length = key, length
        return (best_key, best_length) if best_key is not None else (None, 0)

    def _remember_prefix(self, sequence: _Sequence, routing: torch.Tensor | None) -> None:
        if not self.config.prefix_cache_size or sequence.weights_stamp != self._weights_watch.stamp():
            return
        fed = (sequence.prompt + sequence.tokens)[:-1]
        if len(fed) < self.config.min_prefix_tokens:
            return
        length = len(fed)
        self._prefixes[next(self._prefix_ids)] = _CachedPrefix(
            tokens=torch.tensor(fed),
            keys=self.cache.key_storage[:, sequence.slot, :, :length].clone(),
            values=self.cache.value_storage[:, sequence.slot, :, :length].clone(),
            routing=None if routing is None else routing[:length].clone(),
        )
        while len(self._prefixes) > self.config.prefix_cache_size:
            self._prefixes.popitem(last=False)

    def _decode(self) -> list[TokenEvent]:
        sequences = sorted(self._running.values(), key=lambda s: s.slot)
        input_ids = torch.tensor([s.tokens[-1] for s in sequences], device=self.device).view(-1, 1)
        # the newest token is not in the cache yet: it sits right after the prompt and the earlier tokens
        starts = [len(s.prompt) + len(s.tokens) - 1 for s in sequences]
        logits, routed = self._forward(input_ids, [s.slot for s in sequences], starts, None)
        if routed is not None:
            for sequence, rows in zip(sequences, routed.unbind(0), strict=True):
                sequence.routing.append(rows)
        return self._sample_and_advance(sequences, logits)

    def _forward(
        self, input_ids: torch.Tensor, slots: list[int], starts: list[int], logits_positions: list[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, vocab] at one position per row (default the last) and, when recorded, the CPU
        int16 routing [B, T, n_layers, top_k] of every input token."""
        if self.fused_forward is not None and input_ids.shape[1] <= FUSED_MAX_TOKENS:
            fused = self.fused_forward(
                input_ids,
                self.cache,
                slots=slots,
                starts=starts,
                logits_positions=logits_positions,
                return_routing=self.record_routing,
            )
            logits, routed = fused.logits, fused.routed_experts
        else:
            out = self.model(
                input_ids,
                kv_cache=self.cache,
                cache_slots=torch.tensor(slots, device=self.device),
                return_routing=self.record_routing,
                compute_router_losses=False,
                logits_positions=None
                if logits_positions is None
                else torch.tensor(logits_positions, device=self.device),
            )
            logits, routed = out.logits[:, -1], out.routed_experts
        if not self.record_routing:
            return logits, None
        return logits, routed.to("cpu", torch.int16)

    def _sample_and_advance(self, sequences: list[_Sequence], logits: torch.Tensor) -> list[TokenEvent]:
        temperatures = [s.params.temperature for s in sequences]
        masks = [s.params.constraint.allowed(s.tokens) if s.params.constraint is not None else None
                 for s in sequences]
        constrained = [row for row, mask in enumerate(masks) if mask is not None]
        sampled_logits = logits
        if constrained:
            sampled_logits = logits.float().cpu().clone()  # the model's output buffer stays as it was
            for row in constrained:
                sampled_logits[row].masked_fill_(~masks[row], float("-inf"))
                sequences[row].mask_positions.append(len(sequences[row].tokens))
                sequences[row].mask_rows.append(masks[row])
        tokens, logprobs = sample_tokens(
            sampled_logits,
            temperatures=temperatures,
            top_ps=[s.params.top_p for s in sequences],
            generators=[s.generator for s in sequences],
        )
        alternatives = self._top_logprobs(sequences, sampled_logits, temperatures)
        events = []
        for row, (sequence, token, logprob) in enumerate(zip(sequences, tokens.tolist(), logprobs.tolist(), strict=True)):
            sequence.tokens.append(token)
            sequence.logprobs.append(logprob)
            if alternatives[row] is not None:
                sequence.top_logprobs.append(alternatives[row])
            finish: FinishReason | None = None
            if token in sequence.params.stop_token_ids:
                finish = "stop"
            elif (
                len(sequence.tokens) >= sequence.params.max_tokens
                or len(sequence.prompt) + len(sequence.tokens) >= self.max_seq_len
            ):
                finish = "length"
            result = self._finish(sequence, finish) if finish else None
            events.append(TokenEvent(sequence.request_id, token, logprob, result, alternatives[row]))
        return events

    @staticmethod
    def _top_logprobs(
        sequences: list[_Sequence], logits: torch.Tensor, temperatures: list[float]
    ) -> list[list[tuple[int, float]] | None]:
        """Per row, its request's SamplingParams.top_logprobs most likely tokens, or None when it asked for none."""
        rows = [row for row, sequence in enumerate(sequences) if sequence.params.top_logprobs]
        found: list[list[tuple[int, float]] | None] = [None] * len(sequences)
        if not rows:
            return found
        logprobs = step_logprobs(logits[rows], [temperatures[row] for row in rows])
        widest = max(sequences[row].params.top_logprobs for row in rows)
        for row, best in zip(rows, top_logprobs(logprobs, widest), strict=True):
            found[row] = best[: sequences[row].params.top_logprobs]
        return found

    def _finish(self, sequence: _Sequence, reason: FinishReason) -> GenerationResult:
        routing = torch.cat(sequence.routing) if sequence.routing else None
        self._remember_prefix(sequence, routing)
        self._release(sequence.slot)
        return GenerationResult(
            request_id=sequence.request_id,
            prompt_token_ids=sequence.prompt,
            token_ids=sequence.tokens,
            logprobs=sequence.logprobs,
            finish_reason=reason,
            routed_experts=routing,
            sampling_masks=SamplingMasks(sequence.mask_positions, torch.stack(sequence.mask_rows))
            if sequence.mask_rows else None,
            top_logprobs=sequence.top_logprobs if sequence.params.top_logprobs else None,
        )

    def _release(self, slot: int) -> None:
        del self._running[slot]
        self.cache.release(slot)
        self._free_slots.append(slot)
        self._free_slots.sort()
