"""Slot-based KV cache: each running sequence owns one slot, so sequences join and leave independently."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.model.config import ModelConfig


@dataclass
class CacheBatch:
    """Where one forward pass reads and writes the cache."""

    slots: torch.Tensor
    """int64 [B]: cache slot of each batch row."""

    positions: torch.Tensor
    """int64 [B, T]: absolute positions of the new tokens."""

    slot_slice: slice | None
    """The slots as a slice when they are consecutive (avoids gathering a copy of the cache)."""

    visible: int
    """Cache length every row attends over (the longest row after this pass)."""

    attention_mask: torch.Tensor
    """bool [B, 1, T, visible]: query i of row b sees cached keys at positions <= positions[b, i]."""


class KVCache:
    """Preallocated keys/values [n_layers, slots, kv_heads, max_seq_len, head_dim] plus a length per slot.

    A forward pass with a cache appends its tokens at each slot's current length and advances it;
    `release` makes a slot reusable by the next sequence without touching the other slots.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_batch_size: int,
        max_seq_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        max_seq_len = max_seq_len or config.max_seq_len
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
        if max_seq_len > config.max_seq_len:
            raise ValueError(
                f"KV cache max_seq_len={max_seq_len} exceeds the model's max_seq_len={config.max_seq_len}; "
                "lower it or build the model with a larger max_seq_len."
            )
        shape = (config.n_layers, max_batch_size, config.n_kv_heads, max_seq_len, config.head_dim)
        # One tensor for all layers, so that a decode step can take every layer's prefix in one slice;
        # `keys` / `values` are per-layer views of it.
        self.key_storage = torch.zeros(shape, dtype=dtype, device=device)
        self.value_storage = torch.zeros(shape, dtype=dtype, device=device)
        self.keys = list(self.key_storage.unbind(0))
        self.values = list(self.value_storage.unbind(0))
        self.lengths = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len

    def begin(self, slots: torch.Tensor, n_new: int) -> CacheBatch:
        """Plan a forward pass that appends `n_new` tokens to each of `slots`."""
        start = self.lengths[slots]
        end = int(start.max()) + n_new
        if end > self.max_seq_len:
            raise ValueError(
                f"Sequence would reach {end} tokens, past the KV cache's max_seq_len={self.max_seq_len}; "
                "stop generation earlier or enlarge the cache."
            )
        positions = start[:, None] + torch.arange(n_new, device=start.device)
        first = int(slots[0])
        contiguous = slots.shape[0] == 1 or bool(
            torch.equal(slots, torch.arange(first, first + slots.shape[0], device=slots.device))
        )
        slot_slice = slice(first, first + slots.shape[0]) if contiguous else None
        key_positions = torch.arange(end, device=start.device)
        # Each query sees its own slot's prefix up to its position; the unused slot tail stays masked.
        attention_mask = key_positions.view(1, 1, 1, end) <= positions.view(-1, 1, n_new, 1)
        return CacheBatch(
            slots=slots,
            positions=positions,
            slot_slice=slot_slice,
            visible=end,
            attention_mask=attention_mask,
        )

    def append(
        self, layer: int, batch: CacheBatch, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [B, kv_heads, T, head_dim]; return the batch's cached prefix [B, kv, visible, hd]."""
        layer_keys, layer_values = self.keys[layer], self.values[layer]
        rows = batch.slots[:, None]
        layer_keys[rows, :, batch.positions] = keys.transpose(1, 2).to(layer_keys.dtype)
        layer_values[rows, :, batch.positions] = values.transpose(1, 2).to(layer_values.dtype)
        if batch.slot_slice is not None:
            return (
                layer_keys[batch.slot_slice, :, : batch.visible],
                layer_values[batch.slot_slice, :, : batch.visible],
            )
        return layer_keys[batch.slots, :, : batch.visible], layer_values[batch.slots, :, : batch.visible]

    def advance(self, batch: CacheBatch) -> None:
        self.lengths[batch.slots] += batch.positions.shape[1]

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
