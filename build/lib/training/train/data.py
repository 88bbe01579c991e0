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


class InductionSequences:
    """Synthetic copy data: windows of random tokens in which runs of tokens recur later.

    Each window is a chain of blocks [run, gap, run] (run: 3/32 to 3/8 of seq_len random tokens,
    gap: up to seq_len/4 random tokens); the loss covers the repeated run after its first token,
    which only an attention head that finds the earlier occurrence and copies what followed it can
    predict (an induction head, Olsson et al. 2022). Random gaps rule out a fixed-offset shortcut.
    The fresh "tiny" model sits on a plateau for ~1000 steps of 16 x 256 tokens, then learns it
    within a few hundred; SFT alone never taught it to copy a package name from a bug report into a
    tool call. Sample i is a pure function of (seed, i), like the other sources.
    """

    def __init__(self, *, vocab_size: int, first_token_id: int, seq_len: int, seed: int) -> None:
        if seq_len < 64:
            raise ValueError(f"seq_len={seq_len} is too short for copy blocks; use at least 64.")
        if not 0 <= first_token_id < vocab_size - 1:
            raise ValueError(f"first_token_id={first_token_id} leaves no tokens below vocab_size={vocab_size}.")
        self.vocab_size = vocab_size
        self.first_token_id = first_token_id
        self.seq_len = seq_len
        self.seed = seed
        self.min_run, self.max_run, self.max_gap = max(4, seq_len * 3 // 32), seq_len * 3 // 8, seq_len // 4
        self.n_examples = 2**62  # endless: every sample index is a new window

    def batch(self, *, start: int, size: int) -> Batch:
        input_ids = torch.empty((size, self.seq_len), dtype=torch.long)
        targets = torch.full((size, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        for row, sample in enumerate(range(start, start + size)):
            rng = np.random.default_rng([self.seed, sample])
            tokens = rng.integers(self.first_token_id, self.vocab_size, self.seq_len + 1)
            copied = np.zeros(self.seq_len + 1, dtype=bool)
            position = 0
            while True:
                run = int(rng.integers(self.min_run, self.max_run + 1))
                gap = int(rng.integers(0, self.max_gap + 1))
                end = position + 2 * run + gap
                if end > self.seq_len + 1:
                    break
                tokens[position + run + gap : end] = tokens[position : position + run]
                copied[position + run + gap + 1 : end] = True
                position = end
            window = torch.from_numpy(tokens)
            input_ids[row] = window[:-1]
            targets[row] = torch.where(torch.from_numpy(copied[1:]), window[1:], IGNORE_INDEX)
        return Batch(input_ids=input_ids, targets=targets)


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
