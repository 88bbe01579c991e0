"""Decoder-only MoE transformer: RoPE attention (GQA, or DeepSeek's latent attention), RMSNorm, routed SwiGLU experts."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from training.model.attention import Attention
from training.model.config import ModelConfig
from training.model.kv_cache import CacheBatch, KVCache
from training.model.mla import MLAttention
from training.model.moe import DenseFeedForward, MoEFeedForward, output_init_std
from training.model.rope import RotaryEmbedding


@dataclass
class TransformerOutput:
    """Result of MoETransformer.forward."""

    logits: torch.Tensor
    """float32 [B, T, vocab_size] next-token logits."""

    load_balancing_loss: torch.Tensor
    """Scalar, mean over MoE layers (zero for dense models); the trainer chooses its weight."""

    router_z_loss: torch.Tensor
    """Scalar, mean over MoE layers (zero for dense models); the trainer chooses its weight."""

    routed_experts: torch.Tensor | None
    """int64 [B, T, n_moe_layers, top_k] experts each input token used, when return_routing=True on an MoE."""


@dataclass
class SharedPrefix:
    """Keys and values of a prefix that several rows begin with, computed once by
    MoETransformer.prefix_forward and attended by each row's forward (`prefix=`) in place of its own copy.

    An RL group's rollouts share the system prompt, the tool schemas and the task (over half of each row):
    a learner that runs the prefix once instead of once per rollout does that share of the work once.
    """

    keys: list[torch.Tensor]
    """Per layer, [1, n_kv_heads, P, head_dim] with the rotary embedding applied."""

    values: list[torch.Tensor]
    """Per layer, [1, n_kv_heads, P, head_dim]."""

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values]

    def detached(self) -> SharedPrefix:
        """Leaves that collect the rows' gradients, to be sent through the prefix's graph in one backward
        pass (torch.autograd.backward(prefix.tensors(), [leaf.grad ...])) rather than once per row."""
        return SharedPrefix(
            keys=[key.detach().requires_grad_() for key in self.keys],
            values=[value.detach().requires_grad_() for value in self.values],
        )


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attention = MLAttention(config, layer_index) if config.attention == "mla" else Attention(config, layer_index)
        self.ffn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.feed_forward: MoEFeedForward | DenseFeedForward = (
            MoEFeedForward(config) if config.is_moe_layer(layer_index) else DenseFeedForward(config)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        kv_cache: KVCache | None,
        cache_batch: CacheBatch | None,
        routing_override: torch.Tensor | None,
        compute_router_losses: bool,
        query_positions: torch.Tensor | None = None,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_sink: list | None = None,
    ):
        """query_positions: int [B, N]; run the block's output only at these positions ([B, N, d_model]).
        prefix, kv_sink: as Attention.forward's."""
        attended = self.attention(
            self.attention_norm(x), cos, sin, kv_cache=kv_cache, cache_batch=cache_batch,
            query_positions=query_positions, prefix=prefix, kv_sink=kv_sink,
        )
        if query_positions is not None:
            rows = torch.arange(x.shape[0], device=x.device)[:, None]
            x = x[rows, query_positions]
            if routing_override is not None:
                routing_override = routing_override[rows, query_positions.to(routing_override.device)]
        x = x + attended
        normed = self.ffn_norm(x)
        if isinstance(self.feed_forward, DenseFeedForward):
            return x + self.feed_forward(normed), None
        batch, length, d_model = normed.shape
        override = None if routing_override is None else routing_override.reshape(batch * length, -1)
        out, router = self.feed_forward(
            normed.reshape(batch * length, d_model),
            routing_override=override,
            compute_losses=compute_router_losses,
        )
        return x + out.view(batch, length, d_model), router


class MoETransformer(nn.Module):
    """The policy model. Same class for every size; the dense baseline is feed_forward="dense"."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(TransformerBlock(config, index) for index in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.output = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.embed.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std, out_std = self.config.init_std, output_init_std(self.config)
        nn.init.normal_(self.embed.weight, std=std)
        if not self.config.tie_embeddings:
            nn.init.normal_(self.output.weight, std=std)
        for block in self.layers:
            block.attention.reset_parameters(std=std, output_std=out_std)
            block.feed_forward.reset_parameters(std=std, output_std=out_std)
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        self.norm.reset_parameters()

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        routing_override: torch.Tensor | Sequence[torch.Tensor] | None = None,
        return_routing: bool = False,
        kv_cache: KVCache | None = None,
        cache_slots: torch.Tensor | None = None,
        compute_router_losses: bool = True,
        logits_positions: torch.Tensor | None = None,
        logits_mask: torch.Tensor | None = None,
        prefix: SharedPrefix | None = None,
    ) -> TransformerOutput:
        """Run the model on input_ids [B, T].

        routing_override: expert ids recorded at rollout time, [B, T, n_moe_layers, top_k] or a sequence of
            n_moe_layers tensors [B, T, top_k]; replaces the router's choice (the gate weights still come
            from the current router, so gradients flow to it).
        kv_cache / cache_slots: append the tokens to these cache slots ([B] int) and attend over each
            slot's cached prefix; without a cache the pass is a plain causal forward from position 0.
        compute_router_losses: False skips the load-balancing and z losses (returned as zeros) when
            only logits are needed, e.g. during generation.
        logits_positions: int [B]; when given, logits are computed only at these positions (one per row,
            shape [B, 1, vocab]); generation needs just the last prompt position, which saves the output
            projection over the whole prompt.
        logits_mask: bool [B, T]; when given, logits are computed only where it is True and returned
            flattened to [1, N, vocab] in row-major order (N = its number of True entries), and the last
            block runs only at those positions (earlier blocks run everywhere, since every position is a
            key of the next block). A policy-gradient loss needs outputs only at the sampled tokens, a
            tenth of a rollout's row; the rest would be wasted work. Needs compute_router_losses=False and
            return_routing=False (both would cover only part of the last block), and no kv_cache.
        prefix: a SharedPrefix (prefix_forward) that every row continues: input_ids are the tokens after it,
            at positions P.., and attend its keys and values as if they were the rows' own first P tokens.
            No kv_cache with it.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}.")
        batch, length = input_ids.shape
        if logits_mask is not None:
            _logits_mask_check(
                input_ids, logits_mask, logits_positions=logits_positions, kv_cache=kv_cache,
                compute_router_losses=compute_router_losses, return_routing=return_routing,
            )
        positions, cache_batch = self._positions(input_ids, kv_cache=kv_cache, cache_slots=cache_slots, prefix=prefix)
        overrides = self._layer_overrides(routing_override, batch, length)
        cos, sin = self.rotary(positions)

        autocast = self._autocast(input_ids.device.type)
        last_block_positions = last_block_valid = None
        if logits_mask is not None:
            last_block_positions, last_block_valid = _last_block_queries(logits_mask.to(input_ids.device))
        routers = []
        with autocast:
            hidden = self.embed(input_ids)
            for index, block in enumerate(self.layers):
                last = index == len(self.layers) - 1
                hidden, router = block(
                    hidden,
                    cos,
                    sin,
                    kv_cache=kv_cache,
                    cache_batch=cache_batch,
                    routing_override=None if overrides is None else overrides[index],
                    compute_router_losses=compute_router_losses,
                    query_positions=last_block_positions if last else None,
                    prefix=None if prefix is None else (prefix.keys[index], prefix.values[index]),
                )
                if router is not None:
                    routers.append(router)
            if logits_positions is not None:
                rows = torch.arange(batch, device=hidden.device)
                hidden = hidden[rows, logits_positions.to(hidden.device)].unsqueeze(1)
            elif logits_mask is not None:
                hidden = hidden[last_block_valid].unsqueeze(0)
            hidden = self.norm(hidden)
        logits = self.output(hidden.to(self.output.weight.dtype)).float()
        if kv_cache is not None:
            kv_cache.advance(cache_batch)

        return _transformer_output(logits, routers, routing_shape=(batch, length) if return_routing else None)

    def _positions(
        self,
        input_ids: torch.Tensor,
        *,
        kv_cache: KVCache | None,
        cache_slots: torch.Tensor | None,
        prefix: SharedPrefix | None,
    ) -> tuple[torch.Tensor, CacheBatch | None]:
        """(positions [B, T] of input_ids, the cache batch they append to): after a shared prefix, after each
        cache slot's tokens, or from 0."""
        batch, length = input_ids.shape
        config = self.config
        cache_batch = None
        if prefix is not None and kv_cache is not None:
            raise ValueError("prefix and kv_cache are two ways to supply earlier keys; pass one.")
        if prefix is not None:
            offset = prefix.length
            if offset + length > config.max_seq_len:
                raise ValueError(
                    f"Prefix {offset} + sequence {length} tokens exceeds max_seq_len={config.max_seq_len}."
                )
            positions = torch.arange(offset, offset + length, device=input_ids.device).expand(batch, length)
        elif kv_cache is not None:
            if cache_slots is None or cache_slots.shape != (batch,):
                raise ValueError("kv_cache needs cache_slots, an int tensor [batch] of slot indices.")
            cache_batch = kv_cache.begin(cache_slots.to(kv_cache.lengths.device), length)
            positions = cache_batch.positions.to(input_ids.device)
        else:
            if length > config.max_seq_len:
                raise ValueError(
                    f"Sequence length {length} exceeds max_seq_len={config.max_seq_len}; truncate the "
                    "input or build the model with a larger max_seq_len."
                )
            positions = torch.arange(length, device=input_ids.device).expand(batch, length)
        return positions, cache_batch

    def prefix_forward(self, input_ids: torch.Tensor, *, routing_override: torch.Tensor | None = None) -> SharedPrefix:
        """Every layer's keys and values of a prefix [1, P] (routing_override: [1, P, n_moe_layers, top_k]), for
        forward(prefix=...). The last layer's feed-forward is skipped: nothing reads its output."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"A shared prefix is one row [1, P], got shape {tuple(input_ids.shape)}.")
        length = input_ids.shape[1]
        if length > self.config.max_seq_len:
            raise ValueError(f"Prefix of {length} tokens exceeds max_seq_len={self.config.max_seq_len}.")
        overrides = self._layer_overrides(routing_override, 1, length)
        cos, sin = self.rotary(torch.arange(length, device=input_ids.device)[None])
        autocast = self._autocast(input_ids.device.type)
        sink: list[tuple[torch.Tensor, torch.Tensor]] = []
        with autocast:
            hidden = self.embed(input_ids)
            for index, block in enumerate(self.layers):
                if index == len(self.layers) - 1:
                    sink.append(block.attention.keys_values(block.attention_norm(hidden), cos, sin))
                    break
                hidden, _ = block(
                    hidden, cos, sin, kv_cache=None, cache_batch=None,
                    routing_override=None if overrides is None else overrides[index],
                    compute_router_losses=False, kv_sink=sink,
                )
        return SharedPrefix(keys=[k for k, _ in sink], values=[v for _, v in sink])

    def _autocast(self, device_type: str):
        """bf16 autocast for the low-precision configs, nothing for fp32."""
        if self.config.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=torch.bfloat16)

    def _layer_overrides(
        self, routing_override: torch.Tensor | Sequence[torch.Tensor] | None, batch: int, length: int
    ) -> list[torch.Tensor | None] | None:
        """Per layer (None for dense layers), the recorded experts of a [B, T, MoE layers, top_k] override
        (every layer with a router: all of them, but first_dense_layers)."""
        if routing_override is None:
            return None
        config = self.config
        if not config.is_moe:
            raise ValueError("routing_override was given to a dense model, which has no router.")
        moe_layers = [index for index in range(config.n_layers) if config.is_moe_layer(index)]
        if isinstance(routing_override, torch.Tensor):
            expected = (batch, length, len(moe_layers), config.top_k)
            if tuple(routing_override.shape) != expected:
                raise ValueError(
                    f"routing_override has shape {tuple(routing_override.shape)}, expected {expected} "
                    "= (batch, seq_len, MoE layers, top_k)."
                )
            layers = list(routing_override.unbind(2))
        else:
            layers = list(routing_override)
            if len(layers) != len(moe_layers):
                raise ValueError(f"routing_override has {len(layers)} layers, the model has {len(moe_layers)} MoE layers.")
            for index, layer in enumerate(layers):
                if tuple(layer.shape) != (batch, length, config.top_k):
                    raise ValueError(
                        f"routing_override[{index}] has shape {tuple(layer.shape)}, expected "
                        f"{(batch, length, config.top_k)} = (batch, seq_len, top_k)."
                    )
        per_layer: list[torch.Tensor | None] = [None] * config.n_layers
        for index, layer in zip(moe_layers, layers, strict=True):
            per_layer[index] = layer
        return per_layer

    def parameter_counts(self) -> dict[str, int]:
        return self.config.parameter_counts()

    def materialize(self, device: str | torch.device) -> MoETransformer:
        """Allocate a model built under torch.device("meta") on `device` (weights uninitialised)."""
        self.to_empty(device=device)
        if self.config.tie_embeddings:
            self.output.weight = self.embed.weight
        self.rotary.reset_buffers()
        for block in self.layers:
            if isinstance(block.feed_forward, MoEFeedForward):
                block.feed_forward.reset_buffers()
        return self


def _logits_mask_check(
    input_ids: torch.Tensor,
    logits_mask: torch.Tensor,
    *,
    logits_positions: torch.Tensor | None,
    kv_cache: KVCache | None,
    compute_router_losses: bool,
    return_routing: bool,
) -> None:
    """MoETransformer.forward's rules for logits_mask: a ValueError that says what to pass."""
    if logits_positions is not None:
        raise ValueError("Pass logits_positions or logits_mask, not both.")
    if logits_mask.shape != input_ids.shape or logits_mask.dtype != torch.bool:
        raise ValueError(
            f"logits_mask must be a bool tensor shaped like input_ids {tuple(input_ids.shape)}, got "
            f"{logits_mask.dtype} {tuple(logits_mask.shape)}."
        )
    if compute_router_losses or return_routing or kv_cache is not None:
        raise ValueError(
            "logits_mask runs the last block only at the masked positions: pass "
            "compute_router_losses=False and return_routing=False, and no kv_cache."
        )


def _last_block_queries(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [B, N] the last block runs at, which of them are masked [B, N]) for a logits_mask."""
    counts = mask.sum(dim=1)
    queries = max(int(counts.max()), 1)
    # Each row's masked positions first, in order (a stable sort); shorter rows are padded with
    # other positions of the row, whose outputs are dropped.
    order = torch.sort(mask.to(torch.uint8), dim=1, descending=True, stable=True).indices
    return order[:, :queries], torch.arange(queries, device=mask.device) < counts[:, None]


def _transformer_output(logits: torch.Tensor, routers: list, *, routing_shape: tuple[int, int] | None) -> TransformerOutput:
    """The forward's result: logits, the routers' mean auxiliary losses, and (routing_shape = (B, T) given)
    the experts every position was routed to, [B, T, n_moe_layers, top_k]."""
    zero = logits.new_zeros(())
    routed = None
    if routing_shape is not None and routers:
        routed = torch.stack([r.expert_indices.view(*routing_shape, -1) for r in routers], dim=2)
    return TransformerOutput(
        logits=logits,
        load_balancing_loss=torch.stack([r.load_balancing_loss for r in routers]).mean() if routers else zero,
        router_z_loss=torch.stack([r.router_z_loss for r in routers]).mean() if routers else zero,
        routed_experts=routed,
    )
