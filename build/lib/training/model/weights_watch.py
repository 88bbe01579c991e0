"""Change detection for a module's weights, for caches built from them (fused copies, keys and values)."""

from __future__ import annotations

import weakref

import torch


class WeightsWatch:
    """A stamp of a module's parameters and buffers that differs as soon as any of them changed.

    In-place updates (optimizer steps, copies) bump a tensor's version counter, re-materialised tensors
    (``.to()``) change their storage pointer, and ``load_state_dict`` is counted by a hook: with
    ``assign=True`` it swaps the tensor objects, and tensors made under ``torch.inference_mode`` keep no
    version counter at all. The hook holds the watch weakly and goes with it, so caches built and dropped
    over one long-lived model do not pile up hooks.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._loads = 0
        self._tensors_seen_at = -1
        this = weakref.ref(self)

        def count_load(module: torch.nn.Module, incompatible_keys: object) -> None:
            watch = this()
            if watch is not None:
                watch._loads += 1

        weakref.finalize(self, module.register_load_state_dict_post_hook(count_load).remove)

    def stamp(self) -> tuple:
        """Equal to an earlier stamp exactly when no weight changed in between (called per decode step)."""
        if self._tensors_seen_at != self._loads:
            # the tensor objects only change with load_state_dict, so they are listed once per load
            self._sources = [*self._module.parameters(), *self._module.buffers()]
            self._versioned = [tensor for tensor in self._sources if not tensor.is_inference()]
            self._tensors_seen_at = self._loads
        return (
            self._loads,
            tuple(tensor._version for tensor in self._versioned),
            tuple(tensor.data_ptr() for tensor in self._sources),
        )
