"""Inference-only forward of a MoETransformer over a KV cache, with fused projections, for generation.

A CPU decode step of the "tiny" model is dominated by per-operator overhead (~250 small operators, of
which only the GEMMs do real work), so this path computes the same function as
``MoETransformer.forward(..., kv_cache=...)`` with far fewer operators:

- Q, K, V and the rotate-half of Q and K come out of one matmul: rotate-half is a signed permutation
  of each head's rows, so it folds into the weight and RoPE becomes one multiply and one addcmul
  (imported families' options: attention biases fold alike; with qk-norm or qkv clipping, which sit
  between the projection and RoPE, or when the folded weight would be large (ROTATION_FOLD_MAX_ELEMENTS),
  Q, K and V come out of one matmul and are rotated afterwards);
- attention is baddbmm (scores + additive mask) / softmax / bmm over (batch x kv-head) with the query
  heads of a group as rows, with the mask built once per forward and shared by every layer;
- the MoE router, every expert's gate and every expert's up projection are one matmul when all
  experts are computed (``moe.all_experts_pays``); the top-k weights scale the hidden units, so the down
  projection and the sum over experts are one matmul; the dense variant fuses gate and up alike;
- RMSNorm weights (times sqrt(d_model)) fold into the projections that follow (the final norm's into
  the hidden state, the output weight is too big to copy), leaving a per-token
  1 / sqrt(||x||^2 + d_model * eps) = 1 / hypot(||x||, sqrt(d_model * eps)): three small operators
  instead of the norm's six;
- output projections add into the residual stream in the same call (addmm) in fp32;
- new keys and values are written with one flat index per step, shared by all layers, and when the
  slots are consecutive every layer's cached prefix is a view taken once per step;
- positions and cache lengths come from the caller as Python ints, so nothing waits on a tensor value.

The fused weights are copies (the attention projections, and the gate/up projections of dense models and
of MoE models that may compute every expert; about that much extra memory), rebuilt whenever a parameter
changes: every parameter's version counter
(bumped by in-place updates: ``load_state_dict``, optimizer steps) and storage pointer (``.to()``,
re-materialisation) are compared on each call, and ``load_state_dict(assign=True)``, which swaps the
parameter objects, is caught by a hook. Expert dispatch (many tokens, or MXFP8) runs the model's own
MoE layer. Training keeps using ``MoETransformer.forward``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from training.model.attention import Attention
from training.model.config import ModelConfig
from training.model.fused_moe import DISPATCH_MAX_TOKENS, ExpertViews, expert_views, fused_experts
from training.model.kv_cache import KVCache
from training.model.moe import DenseFeedForward, MoEFeedForward, all_experts_pays, all_experts_possible
from training.model.transformer import MoETransformer, TransformerBlock
from training.model.weights_watch import WeightsWatch


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tensor in dtype, skipping the no-op cast call (not free, and there are several per layer) in fp32."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


TRANSPOSED_LOGITS_MIN_ELEMENTS = 1 << 20
"""CPU output weights of at least this many elements (4 MB in fp32) multiply as (W @ h.T).T: a decode step
reads such a weight from memory (it does not stay in cache between steps), and MKL streams it ~1.5x
faster in that form than F.linear's h @ W.T (4096 x 256, 8 rows, CPU: 0.57 vs 0.78 ms cold); a small
one stays cached, where F.linear is faster (2048 x 128: 75 vs 160 us)."""


def _logits(hidden: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """hidden [B, d_model] @ output.T [d_model, vocab], contiguous [B, vocab]."""
    if output.device.type == "cpu" and output.numel() >= TRANSPOSED_LOGITS_MIN_ELEMENTS:
        return torch.mm(output, hidden.t()).t().contiguous()
    return F.linear(hidden, output)


@dataclass
class FusedOutput:
    logits: torch.Tensor
    """float32 [B, vocab_size]: next-token logits at one position per row."""

    routed_experts: torch.Tensor | None
    """int64 [B, T, n_layers, top_k] experts each input token used, when asked for on an MoE model."""


def _norm_scale(norm: torch.nn.RMSNorm) -> torch.Tensor:
    """rms_norm(x) == x / sqrt(||x||^2 + d * eps) * (weight * sqrt(d)); the caller computes the first factor."""
    return norm.weight * math.sqrt(norm.weight.shape[0])


def _in_out(weight: torch.Tensor) -> torch.Tensor:
    """An nn.Linear-style [out, in] weight as a contiguous [in, out] copy."""
    return weight.t().contiguous()


def _rotate_half_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of W such that x @ W_rot.T == rotate_half(x @ W.T) head by head (negation and reordering only)."""
    heads = weight.view(n_heads, weight.shape[0] // n_heads, weight.shape[1])
    first, second = heads.chunk(2, dim=1)
    return torch.cat([-second, first], dim=1).reshape(weight.shape)


ROTATION_FOLD_MAX_ELEMENTS = 1 << 17
"""Largest folded Q/K/V/rotate-half projection (elements; 512 KB in fp32) that is built. Folding spares
three small operators per layer but makes the weight (2 * n_heads + 3 * n_kv_heads) / (n_heads +
2 * n_kv_heads) times larger (1.75x for 8 query and 4 key heads), and a decode step reads a large one from
memory: Mixtral of bench_hf_engine (256 x 896 folded) decodes ~3% faster unfolded, the "tiny" model
(128 x 448) alike either way."""


def _rotation_folds(config: ModelConfig) -> bool:
    """Whether rotate_half(Q), rotate_half(K) come out of the projection: nothing nonlinear (qk-norm,
    clipping) sits between the projection and the rotary embedding, and the folded weight is small."""
    folded_heads = 2 * config.n_heads + 3 * config.n_kv_heads
    small = config.d_model * folded_heads * config.head_dim <= ROTATION_FOLD_MAX_ELEMENTS
    return config.qk_norm == "none" and config.clip_qkv is None and small


def _per_head_qk_norm(attention: Attention, n_heads: int, n_kv_heads: int) -> torch.Tensor | None:
    """[n_heads + n_kv_heads, head_dim] qk-norm weights of every query then key head ("head" qk-norm only)."""
    if attention.qk_norm != "head" or attention.q_norm is None or attention.k_norm is None:
        return None
    q_weight, k_weight = attention.q_norm.weight, attention.k_norm.weight
    return torch.cat([q_weight.expand(n_heads, -1), k_weight.expand(n_kv_heads, -1)])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


@dataclass
class _LayerWeights:
    qkv_rotated: torch.Tensor
    """[d_model, (2 * n_heads + 3 * n_kv_heads) * head_dim]: columns of Q, K, V, rotate_half(Q), rotate_half(K),
    rows scaled by the attention norm (see _norm_scale); only Q, K, V ([d_model, (n_heads + 2 * n_kv_heads)
    * head_dim]) when the rotation does not fold (_rotation_folds). Every fused weight is stored [in, out],
    which torch.mm takes without a transpose (measurably faster than F.linear for a few rows)."""
    qkv_bias: torch.Tensor | None
    """The projection's bias in the same column order (qkv_bias models), else None."""
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    """qk-norm weights ([head_dim] per head, or [heads * head_dim] for "full"), else None."""
    qk_norm: torch.Tensor | None
    """Per-head qk-norm: [n_heads + n_kv_heads, head_dim], q_norm's weight for every query head then
    k_norm's for every key head (one multiply after one norm over all of them); else None."""
    attention_out: torch.Tensor
    """[n_heads * head_dim, d_model] (wo transposed, a view)."""
    attention_out_bias: torch.Tensor | None
    """wo's bias (output_bias models), else None."""
    ffn_norm: torch.Tensor
    """The feed-forward norm's weight times sqrt(d_model), for the model's own MoE layer (dispatch)."""
    ffn_in: torch.Tensor | None
    """Dense: [d_model, 2 * d_ff] gate and up. MoE: [d_model, E + 2 * E * d_ff] router, every expert's
    gate, every expert's up; rows scaled by the feed-forward norm; None for MoE models that never compute
    every expert (too many experts per routed one, or MXFP8)."""
    ffn_out: torch.Tensor
    """[d_ff or E * d_ff, d_model]: the down projection(s) stacked along the hidden units (a view)."""
    feed_forward: MoEFeedForward | DenseFeedForward
    experts: ExpertViews | None
    """Per-expert weight views for training.model.fused_moe's dispatch (fp32 MoE layers), else None."""


class _Weights:
    """Fused copies of one model's weights plus what they were built from, to detect changes."""

    def __init__(self, model: MoETransformer, stamp: tuple) -> None:
        config = model.config
        self.stamp = stamp
        """The WeightsWatch stamp of the weights these copies were made from."""
        compute_dtype = torch.float32 if config.precision == "fp32" else torch.bfloat16
        # [max_seq_len, 2, 1, head_dim]: one gather per forward yields cos and sin broadcastable over heads
        self.cos_sin = torch.stack([model.rotary.cos, model.rotary.sin], dim=1).unsqueeze(2).to(compute_dtype)
        self.embed = model.embed.weight
        # The (tied, vocabulary-sized) output weight is used as it is rather than copied with the norm
        # folded in: the final norm's weight costs one multiply of [B, d_model].
        self.norm = _norm_scale(model.norm)
        self.output = model.output.weight
        folds = _rotation_folds(config)
        self.layers = [self._layer(block, config.n_heads, config.n_kv_heads, folds) for block in model.layers]

    @staticmethod
    def _layer(block: TransformerBlock, n_heads: int, n_kv_heads: int, folds: bool) -> _LayerWeights:
        attention, feed_forward = block.attention, block.feed_forward
        wq, wk, wv = attention.wq.weight, attention.wk.weight, attention.wv.weight
        rotated = [_rotate_half_rows(wq, n_heads), _rotate_half_rows(wk, n_kv_heads)] if folds else []
        qkv_rotated = _in_out(torch.cat([wq, wk, wv, *rotated]) * _norm_scale(block.attention_norm))
        qkv_bias = None
        if attention.wq.bias is not None:
            bq, bk, bv = attention.wq.bias, attention.wk.bias, attention.wv.bias
            rotated = [_rotate_half_rows(bq[:, None], n_heads)[:, 0], _rotate_half_rows(bk[:, None], n_kv_heads)[:, 0]]
            qkv_bias = torch.cat([bq, bk, bv, *(rotated if folds else [])])
        ffn_norm = _norm_scale(block.ffn_norm)
        if isinstance(feed_forward, DenseFeedForward):
            ffn_in = _in_out(torch.cat([feed_forward.w_gate.weight, feed_forward.w_up.weight]) * ffn_norm)
            ffn_out = feed_forward.w_down.weight.t()
        else:
            n_experts, d_model, d_ff = feed_forward.w_gate.shape
            ffn_in = None
            # only models that may take the all-experts path pay for this copy of every expert's gate and up
            if all_experts_possible(feed_forward.config):
                # expert-major hidden units: unit e * d_ff + j is expert e's unit j
                ffn_in = _in_out(
                    torch.cat(
                        [
                            feed_forward.router.weight,
                            feed_forward.w_gate.permute(0, 2, 1).reshape(n_experts * d_ff, d_model),
                            feed_forward.w_up.permute(0, 2, 1).reshape(n_experts * d_ff, d_model),
                        ]
                    )
                    * ffn_norm
                )
            ffn_out = feed_forward.w_down.reshape(n_experts * d_ff, d_model)
        return _LayerWeights(
            qkv_rotated=qkv_rotated,
            qkv_bias=qkv_bias,
            q_norm=None if attention.q_norm is None else attention.q_norm.weight,
            k_norm=None if attention.k_norm is None else attention.k_norm.weight,
            qk_norm=_per_head_qk_norm(attention, n_heads, n_kv_heads),
            attention_out=attention.wo.weight.t(),
            attention_out_bias=attention.wo.bias,
            ffn_norm=ffn_norm,
            ffn_in=ffn_in,
            ffn_out=ffn_out,
            feed_forward=feed_forward,
            experts=None if isinstance(feed_forward, DenseFeedForward) else expert_views(feed_forward),
        )


@dataclass
class _Step:
    """What every layer of one forward shares."""

    batch: int
    length: int
    visible: int
    """Cache positions every row attends over (the longest row after this forward)."""
    ends: torch.Tensor
    """int64 [B]: the slots' cache lengths after this forward."""
    cache_index: torch.Tensor
    """int64 [B * T, kv_heads]: where each new key/value row goes in a layer's cache viewed as [-1, head_dim]."""
    slots: torch.Tensor | None
    """int64 [B] cache slots, only when they are not consecutive (the cache is then gathered per layer)."""
    layer_keys: Sequence[torch.Tensor] | None
    """Per layer [B * kv_heads, head_dim, visible]: views of the cached keys, transposed for the scores,
    when the slots are consecutive."""
    layer_values: Sequence[torch.Tensor] | None
    """Per layer [B * kv_heads, visible, head_dim] views, when the slots are consecutive."""
    mask: torch.Tensor
    """[B * kv_heads, groups * T, visible] additive attention mask (0 or -inf)."""
    cos: torch.Tensor
    sin: torch.Tensor
    """[B * T, 1, head_dim] each."""


def fused_forward_supports(config: ModelConfig) -> bool:
    """Whether the fused path computes this model: the imported families' attention options (qk-norm per
    head or over all heads, attention biases, qkv clipping) yes; latent attention and DeepSeek's routing
    options (sigmoid scores, groups, shared experts, dense layers, scaled gates) not: those models run
    MoETransformer.forward instead."""
    plain_moe = (config.router_score == "softmax" and not config.router_score_bias and config.n_expert_groups == 1
                 and not config.n_shared_experts and not config.first_dense_layers
                 and config.routed_scaling_factor == 1.0)
    return config.attention == "gqa" and config.qk_norm in ("none", "head", "full") and plain_moe


class FusedForward:
    """Callable inference forward of `model` over a KVCache; see the module docstring."""

    def __init__(self, model: MoETransformer) -> None:
        config = model.config
        self.model = model
        self.config = config
        self.groups = config.n_heads // config.n_kv_heads
        self.rotation_folds = _rotation_folds(config)
        # heads of the fused QKV projection: Q and K (to be rotated), V, rotate_half(Q) and rotate_half(K);
        # Q, K and V when the rotation does not fold
        self.projection_heads = (
            (config.n_heads + config.n_kv_heads, config.n_kv_heads, config.n_heads + config.n_kv_heads)
            if self.rotation_folds
            else (config.n_heads, config.n_kv_heads, config.n_kv_heads)
        )
        self.scale = 1.0 / math.sqrt(config.head_dim)
        device = model.embed.weight.device
        self.norm_epsilon_root = torch.tensor(math.sqrt(config.d_model * config.norm_eps), device=device)
        self.autocast_dtype = None if config.precision == "fp32" else torch.bfloat16
        self._weights: _Weights | None = None
        self._watch = WeightsWatch(model)

    def weights(self) -> _Weights:
        stamp = self._watch.stamp()
        if self._weights is None or self._weights.stamp != stamp:
            self._weights = _Weights(self.model, stamp)
        return self._weights

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        *,
        slots: Sequence[int],
        starts: Sequence[int],
        logits_positions: Sequence[int] | None = None,
        return_routing: bool = False,
    ) -> FusedOutput:
        """Append input_ids [B, T] to cache `slots` at positions starts[b]..starts[b] + T - 1.

        starts must equal the slots' cached lengths (the caller tracks them, so no tensor is read back);
        the slots' lengths become starts + T. Logits come from logits_positions (one per row; default the
        last position).
        """
        weights = self.weights()
        step = self._plan(input_ids, cache, slots, starts, weights)
        autocast = (
            contextlib.nullcontext()
            if self.autocast_dtype is None
            else torch.autocast(input_ids.device.type, dtype=self.autocast_dtype)
        )
        routing: list[torch.Tensor] = []
        with autocast:
            hidden = F.embedding(input_ids.reshape(-1), weights.embed)
            for index, layer in enumerate(weights.layers):
                hidden = self._attention(hidden, layer, index, cache, step)
                hidden = self._feed_forward(hidden, layer, routing)
            if logits_positions is not None:
                rows = [row * step.length + position for row, position in enumerate(logits_positions)]
                hidden = hidden.index_select(0, torch.tensor(rows, device=hidden.device))
            elif step.length > 1:
                hidden = hidden.view(step.batch, step.length, -1)[:, -1]
            hidden = self._normalized(hidden) * weights.norm
        logits = _logits(_as(hidden, weights.output.dtype), weights.output).float()
        if step.slots is None:
            cache.lengths[slots[0] : slots[0] + step.batch] = step.ends
        else:
            cache.lengths[step.slots] = step.ends
        routed = None
        if return_routing and routing:
            routed = torch.stack(routing, dim=1).view(step.batch, step.length, len(routing), -1)
        return FusedOutput(logits=logits, routed_experts=routed)

    def _plan(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        slots: Sequence[int],
        starts: Sequence[int],
        weights: _Weights,
    ) -> _Step:
        batch, length = input_ids.shape
        if len(slots) != batch or len(starts) != batch:
            raise ValueError(
                f"Need one slot and one start per row: {batch} rows, {len(slots)} slots, {len(starts)} starts."
            )
        visible = max(starts) + length
        if visible > cache.max_seq_len:
            raise ValueError(
                f"Sequence would reach {visible} tokens, past the KV cache's max_seq_len={cache.max_seq_len}; "
                "stop generation earlier or enlarge the cache."
            )
        device = input_ids.device
        config = self.config
        n_layers, n_kv_heads, head_dim = config.n_layers, config.n_kv_heads, config.head_dim
        # every integer the step needs, in one tensor (building tensors from lists is not cheap)
        tokens = batch * length
        numbers = torch.tensor(
            [
                *(start + offset for start in starts for offset in range(length)),
                *(start + length for start in starts),
                # flat row of (slot, kv head, position) in a layer's [slots, kv_heads, max_seq_len, head_dim]
                *(
                    (slot * n_kv_heads + head) * cache.max_seq_len + start + offset
                    for slot, start in zip(slots, starts, strict=True)
                    for offset in range(length)
                    for head in range(n_kv_heads)
                ),
                *slots,
            ],
            device=device,
        )
        positions = numbers[:tokens].view(batch, length)
        ends = numbers.narrow(0, tokens, batch)
        cache_index = numbers.narrow(0, tokens + batch, tokens * n_kv_heads).view(tokens, n_kv_heads)
        blocked = torch.arange(visible, device=device) > positions.unsqueeze(-1)
        mask = (
            torch.where(blocked, float("-inf"), 0.0)
            .view(batch, 1, 1, length, visible)
            .expand(batch, n_kv_heads, self.groups, length, visible)
            .reshape(batch * n_kv_heads, self.groups * length, visible)
        )
        cos, sin = weights.cos_sin.index_select(0, positions.view(-1)).unbind(1)
        first = slots[0]
        consecutive = list(slots) == list(range(first, first + batch))
        layer_keys = layer_values = None
        if consecutive:
            # the views see the keys and values each layer writes before it attends
            grouped = (n_layers, batch * n_kv_heads, visible, head_dim)
            keys = cache.key_storage.narrow(1, first, batch).narrow(3, 0, visible).reshape(grouped)
            values = cache.value_storage.narrow(1, first, batch).narrow(3, 0, visible).reshape(grouped)
            layer_keys, layer_values = keys.transpose(2, 3).unbind(0), values.unbind(0)
        return _Step(
            batch=batch,
            length=length,
            visible=visible,
            ends=ends,
            cache_index=cache_index,
            slots=None if consecutive else numbers[-batch:],
            layer_keys=layer_keys,
            layer_values=layer_values,
            mask=mask,
            cos=cos,
            sin=sin,
        )

    def _normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x / sqrt(||x||^2 + d_model * eps) per row: RMSNorm up to its weight, which the next projection holds."""
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return x / torch.hypot(norm, self.norm_epsilon_root)

    def _add_projection(
        self, residual: torch.Tensor, x: torch.Tensor, weight_t: torch.Tensor
    ) -> torch.Tensor:
        if self.autocast_dtype is None:
            return torch.addmm(residual, x, weight_t)
        # addmm under autocast would round the residual stream itself to bf16
        return residual + x @ weight_t

    def _attention(
        self, hidden: torch.Tensor, layer: _LayerWeights, index: int, cache: KVCache, step: _Step
    ) -> torch.Tensor:
        config = self.config
        n_heads, n_kv_heads, head_dim, groups = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
            self.groups,
        )
        batch, length, visible = step.batch, step.length, step.visible
        tokens = batch * length
        normed = self._normalized(hidden)
        projected = (
            torch.mm(normed, layer.qkv_rotated)
            if layer.qkv_bias is None
            else torch.addmm(layer.qkv_bias, normed, layer.qkv_rotated)
        ).view(tokens, -1, head_dim)
        if self.rotation_folds:
            # split_with_sizes: Tensor.split is a Python wrapper around it, which shows at this call rate
            query_key, value, query_key_rotated = projected.split_with_sizes(self.projection_heads, dim=1)
        elif self.config.qk_norm == "none" and self.config.clip_qkv is None:
            query_key, value = projected.split_with_sizes((n_heads + n_kv_heads, n_kv_heads), dim=1)
            query_key_rotated = _rotate_half(query_key)
        else:
            query_key, value = self._normed_clipped(projected, layer)
            query_key_rotated = _rotate_half(query_key)
        query, key = torch.addcmul(query_key * step.cos, query_key_rotated, step.sin).split_with_sizes(
            (n_heads, n_kv_heads), dim=1
        )

        layer_keys, layer_values = cache.keys[index], cache.values[index]
        target = (step.cache_index,)
        layer_keys.view(-1, head_dim).index_put_(target, _as(key, layer_keys.dtype))
        layer_values.view(-1, head_dim).index_put_(target, _as(value, layer_values.dtype))
        if step.slots is None:
            keys_transposed, values = step.layer_keys[index], step.layer_values[index]
        else:
            grouped = (batch * n_kv_heads, visible, head_dim)
            keys_transposed = (
                layer_keys.narrow(2, 0, visible).index_select(0, step.slots).view(grouped).transpose(1, 2)
            )
            values = layer_values.narrow(2, 0, visible).index_select(0, step.slots).view(grouped)
        keys_transposed, values = _as(keys_transposed, query.dtype), _as(values, query.dtype)

        # rows of one (sequence, kv head) group: its query heads x its new positions
        if length == 1:
            grouped_queries = query.reshape(batch * n_kv_heads, groups, head_dim)
        else:
            grouped_queries = (
                query.view(batch, length, n_kv_heads, groups, head_dim)
                .permute(0, 2, 3, 1, 4)
                .reshape(batch * n_kv_heads, groups * length, head_dim)
            )
        scores = torch.baddbmm(step.mask, grouped_queries, keys_transposed, alpha=self.scale)
        attended = torch.bmm(scores.softmax(dim=-1), values)
        if length == 1:
            attended = attended.view(tokens, n_heads * head_dim)
        else:
            attended = (
                attended.view(batch, n_kv_heads, groups, length, head_dim)
                .permute(0, 3, 1, 2, 4)
                .reshape(tokens, n_heads * head_dim)
            )
        if layer.attention_out_bias is not None:
            hidden = hidden + layer.attention_out_bias
        return self._add_projection(hidden, attended, layer.attention_out)

    def _normed_clipped(self, projected: torch.Tensor, layer: _LayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q and K [tokens, n_heads + n_kv_heads, head_dim], V) after qk-norm and clipping, in
        Attention._project's order: the norm over all heads, the per-head norm, then the clamp."""
        config = self.config
        tokens, _, head_dim = projected.shape
        query_key, value = projected.split_with_sizes((config.n_heads + config.n_kv_heads, config.n_kv_heads), 1)
        if config.qk_norm == "head":
            # one norm over every Q and K head; the weight (a per-head copy, see _LayerWeights) multiplies
            # afterwards, which is what F.rms_norm computes with it, bit for bit
            query_key = F.rms_norm(query_key, (head_dim,), None, config.norm_eps) * layer.qk_norm
        elif config.qk_norm == "full":
            query, key = query_key.split_with_sizes((config.n_heads, config.n_kv_heads), 1)
            query = F.rms_norm(query.reshape(tokens, -1), (query.shape[1] * head_dim,), layer.q_norm, config.norm_eps)
            key = F.rms_norm(key.reshape(tokens, -1), (key.shape[1] * head_dim,), layer.k_norm, config.norm_eps)
            query_key = torch.cat([query.view(tokens, -1, head_dim), key.view(tokens, -1, head_dim)], 1)
        if config.clip_qkv is not None:
            query_key = query_key.clamp(-config.clip_qkv, config.clip_qkv)
            value = value.clamp(-config.clip_qkv, config.clip_qkv)
        return query_key, value

    def _feed_forward(
        self, hidden: torch.Tensor, layer: _LayerWeights, routing: list[torch.Tensor]
    ) -> torch.Tensor:
        config = self.config
        normed = self._normalized(hidden)
        feed_forward = layer.feed_forward
        if isinstance(feed_forward, DenseFeedForward):
            gate, up = torch.mm(normed, layer.ffn_in).chunk(2, dim=-1)
            return self._add_projection(hidden, F.silu(gate) * up, layer.ffn_out)
        n_tokens = normed.shape[0]
        if layer.ffn_in is None or not all_experts_pays(config, n_tokens):
            if layer.experts is not None and n_tokens <= DISPATCH_MAX_TOKENS:
                out, expert_indices = fused_experts(normed * layer.ffn_norm, layer.experts, config)
                routing.append(expert_indices)
                return hidden + out
            out, router = feed_forward(normed * layer.ffn_norm, compute_losses=False)
            routing.append(router.expert_indices)
            return hidden + out
        n_experts, top_k = config.n_experts, config.top_k
        projected = torch.mm(normed, layer.ffn_in)
        router_logits = _as(projected[:, :n_experts], torch.float32)
        if config.normalize_top_k_weights:
            # softmax over all experts then renormalising the top k equals a softmax over the top-k logits
            top_logits, expert_indices = router_logits.topk(top_k, dim=-1)
            weights = top_logits.softmax(dim=-1)
        else:
            weights, expert_indices = router_logits.softmax(dim=-1).topk(top_k, dim=-1)
        routing.append(expert_indices)
        gate, up = projected[:, n_experts:].view(n_tokens, 2, -1).unbind(1)
        hidden_units = F.silu(gate) * up
        expert_weights = torch.zeros_like(router_logits).scatter_(1, expert_indices, weights)
        # unrouted experts get weight 0; the down projection then sums the routed experts' outputs
        hidden_units.view(n_tokens, n_experts, -1).mul_(_as(expert_weights, hidden_units.dtype).unsqueeze(-1))
        return self._add_projection(hidden, hidden_units, layer.ffn_out)
