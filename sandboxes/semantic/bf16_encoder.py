"""An indexing path for CPUs with bfloat16 matrix instructions: the same encoder on torch, in bfloat16.

Texts are tokenized once, sorted by length and batched as in the ONNX path (no padding to
``max_seq_length``); only the transformer runs under bfloat16 autocast, pooling and normalisation are
float32. Measured on this repository's 2-core AMD EPYC (AVX512-BF16, no AMX): 3.96x the reference, below
ONNX Runtime int8's 4.69x in the same run (BENCHMARKS.md), so ``onnx-int8`` stays the default; bfloat16 keeps
the vectors closer to the reference than int8 does (``tests/semantic/test_fast_encoder.py`` states both
bounds). Chosen with ``SEMANTIC_ENCODER_BACKEND=torch-bf16``; on CPUs with AMX tiles it may be faster than
int8 (not measured: no such machine here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from sandboxes.semantic.encoder import embedding_dimension
from sandboxes.semantic.fast_encoder import encode_length_batched, pipeline_stage

if TYPE_CHECKING:
    from collections.abc import Callable

    from sentence_transformers import SentenceTransformer


class TorchBf16TextEncoder:
    """Unit-normalised float32 embeddings from the encoder's transformer run under bfloat16 autocast."""

    name = "torch-bf16"

    def __init__(self, *, model: SentenceTransformer, max_seq_length: int) -> None:
        self._transformer = pipeline_stage(model, 0).auto_model
        self._tokenizer = model.tokenizer
        self._max_seq_length = max_seq_length
        self._dimension = embedding_dimension(model)

    @property
    def dimension(self) -> int:
        return self._dimension

    def encode(
        self, texts: list[str], *, batch_size: int, progress: Callable[[int], None] | None = None
    ) -> np.ndarray:
        import torch

        with torch.inference_mode():
            return encode_length_batched(tokenizer=self._tokenizer, texts=texts, max_seq_length=self._max_seq_length,
                                         batch_size=batch_size, dimension=self._dimension, run=self._run,
                                         progress=progress)

    def _run(self, input_ids: np.ndarray, attention: np.ndarray) -> np.ndarray:
        import torch

        ids, mask = torch.from_numpy(input_ids), torch.from_numpy(attention)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = self._transformer(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))[0]
        weights = mask.unsqueeze(-1).to(torch.float32)
        pooled = (hidden.float() * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2.0, dim=1).numpy()
