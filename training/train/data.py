"""Batches as a pure function of (seed, sample position): the data side of exact resume.

Both data sources index samples with one global counter. Sample i lives in epoch i // n and is
example permutation_epoch[i % n], where each epoch's permutation is drawn from its own generator
seeded with (seed, epoch). So the data position of a run is a single integer (samples consumed) and
a resumed run draws exactly the batches the uninterrupted run would have drawn, with no iterator
state to pickle. Data-parallel ranks take disjoint slices of the same global batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass
class Batch:
    """One micro-batch of next-token prediction."""

    input_ids: torch.Tensor
    """int64 [B, T] tokens fed to the model."""

    targets: torch.Tensor
    """int64 [B, T] the next token at each position; IGNORE_INDEX where no loss is taken."""

    @property
    def n_target_tokens(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())


class _PermutedIndex:
    def __init__(self, n_examples: int, seed: int) -> None:
        if n_examples < 1:
            raise ValueError("The data source holds no examples; give it more text or trajectories.")
        self.n_examples = n_examples
        self.seed = seed
        self._cached_epoch = -1
        self._permutation = np.arange(0)

    def example(self, sample: int) -> int:
        epoch, offset = divmod(sample, self.n_examples)
        if epoch != self._cached_epoch:
            self._permutation = np.random.default_rng([self.seed, epoch]).permutation(self.n_examples)
            self._cached_epoch = epoch
        return int(self._permutation[offset])


class PackedTokenWindows:
    """Pretraining data: documents joined with a separator and cut into windows of seq_len + 1 tokens."""

    def __init__(self, *, documents: Iterable[Sequence[int]], separator_id: int, seq_len: int, seed: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}.")
        stream: list[int] = []
        for document in documents:
            stream.extend(document)
            stream.append(separator_id)
        self.tokens = np.asarray(stream, dtype=np.int64)
        self.seq_len = seq_len
        n_windows = (len(self.tokens) - 1) // seq_len
        if n_windows < 1:
            raise ValueError(
                f"The corpus has {len(self.tokens)} tokens, fewer than one window of seq_len+1={seq_len + 1}; "
                "add text (raise max_bytes / extra_dirs) or lower seq_len."
            )
        self.n_examples = n_windows
        self._index = _PermutedIndex(n_windows, seed)

    def batch(self, *, start: int, size: int) -> Batch:
        rows = []
        for sample in range(start, start + size):
            window = self._index.example(sample)
            rows.append(self.tokens[window * self.seq_len : window * self.seq_len + self.seq_len + 1])
        block = torch.from_numpy(np.stack(rows))
        return Batch(input_ids=block[:, :-1].clone(), targets=block[:, 1:].clone())


@dataclass
class TokenizedExample:
    """One training sequence with a per-token flag saying whether the loss covers it."""

    token_ids: list[int]
    """The whole rendered conversation."""

    trainable: list[bool]
    """True on tokens the model must learn to produce (assistant turns)."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.trainable):
            raise ValueError("token_ids and trainable must have the same length.")


class MaskedExamples:
    """SFT data: variable-length examples, right-padded per batch, loss only where `trainable`."""

    def __init__(self, *, examples: Sequence[TokenizedExample], pad_id: int, max_seq_len: int, seed: int) -> None:
        usable = [example for example in examples if any(example.trainable[1 : max_seq_len + 1])]
        if not usable:
            raise ValueError(
                "No example has a trainable (assistant) token within max_seq_len; check that the "
                "trajectories contain assistant messages and that max_seq_len is large enough."
            )
        self.examples = list(usable)
        self.dropped = len(examples) - len(usable)
        self.pad_id = pad_id
        self.max_seq_len = max_seq_len
        self.n_examples = len(self.examples)
        self._index = _PermutedIndex(len(self.examples), seed)

    def batch(self, *, start: int, size: int) -> Batch:
        chosen = [self.examples[self._index.example(sample)] for sample in range(start, start + size)]
        length = min(self.max_seq_len, max(len(example.token_ids) - 1 for example in chosen))
        input_ids = torch.full((size, length), self.pad_id, dtype=torch.long)
        targets = torch.full((size, length), IGNORE_INDEX, dtype=torch.long)
        for row, example in enumerate(chosen):
            ids = torch.tensor(example.token_ids[: length + 1], dtype=torch.long)
            trainable = torch.tensor(example.trainable[: length + 1], dtype=torch.bool)
            n = ids.shape[0] - 1
            input_ids[row, :n] = ids[:-1]
            targets[row, :n] = torch.where(trainable[1:], ids[1:], IGNORE_INDEX)
        return Batch(input_ids=input_ids, targets=targets)
