"""The indexing fast path: the same sentence-transformers encoder run by ONNX Runtime.

The model is exported once per (weights, sequence length, precision) with ``torch.onnx`` from the
local checkpoint (the bundled MiniLM or a ``train_embeddings`` output; nothing is downloaded), the
export including mean pooling and normalisation, and optionally quantized to int8 weights with
ONNX Runtime's dynamic quantization. Texts are tokenized once, sorted by length and batched so a
batch pads to its own longest text only, never to ``max_seq_length``.

``tests/semantic/test_fast_encoder.py`` bounds how far these vectors may move from the reference
(sentence-transformers on torch); the retrieval benchmark re-measures recall with them.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from filelock import FileLock

from sandboxes.semantic.config import SemanticSearchError

if TYPE_CHECKING:
    from collections.abc import Callable

    from sentence_transformers import SentenceTransformer

ONNX_BACKENDS = ("onnx", "onnx-int8")
_EXPORT_OPSET = 17


def _check_architecture(model: SentenceTransformer) -> None:
    """The export reproduces Transformer -> mean Pooling -> Normalize only; anything else is refused."""
    names = [type(module).__name__ for module in model]
    if names[:2] != ["Transformer", "Pooling"] or any(name not in ("Transformer", "Pooling", "Normalize") for name in names):
        raise SemanticSearchError(
            f"the ONNX encoder backend supports Transformer + Pooling (+ Normalize) models, not {names}; "
            "set SEMANTIC_ENCODER_BACKEND=torch for this model"
        )
    pooling = model[1].get_config_dict()
    mode = pooling.get("pooling_mode") or ("mean" if pooling.get("pooling_mode_mean_tokens") else "other")
    if mode != "mean" or not pooling.get("include_prompt", True):
        raise SemanticSearchError(
            f"the ONNX encoder backend supports mean pooling over every token, not {pooling}; "
            "set SEMANTIC_ENCODER_BACKEND=torch for this model"
        )


def _export(*, model: SentenceTransformer, destination: Path) -> None:
    import torch

    transformer = model[0].auto_model

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.transformer(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=torch.zeros_like(input_ids)
            )[0]
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    sample = model.tokenizer(["def example(value):\n    return value"], return_tensors="pt")
    with torch.inference_mode():
        torch.onnx.export(
            Pooled().eval(),
            (sample["input_ids"], sample["attention_mask"]),
            str(destination),
            input_names=["input_ids", "attention_mask"],
            output_names=["embedding"],
            dynamic_axes={"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"},
                          "embedding": {0: "batch"}},
            opset_version=_EXPORT_OPSET,
            dynamo=False,
        )


def _quantize(*, source: Path, destination: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(source), str(destination), weight_type=QuantType.QInt8, per_channel=True)


def onnx_model_path(*, model: SentenceTransformer, cache_dir: Path, backend: str) -> Path:
    """The exported (and for ``onnx-int8`` quantized) model under ``cache_dir``, made once across processes."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / ("model.int8.onnx" if backend == "onnx-int8" else "model.onnx")
    if target.is_file():
        return target
    with FileLock(str(cache_dir / "export.lock")):
        if target.is_file():
            return target
        _check_architecture(model)
        exported = cache_dir / "model.onnx"
        if not exported.is_file():
            staging = cache_dir / f".model.{uuid.uuid4().hex}.onnx"
            _export(model=model, destination=staging)
            os.replace(staging, exported)
        if backend == "onnx-int8":
            staging = cache_dir / f".model.int8.{uuid.uuid4().hex}.onnx"
            try:
                _quantize(source=exported, destination=staging)
                os.replace(staging, target)
            finally:
                staging.unlink(missing_ok=True)
    return target


class OnnxTextEncoder:
    """Unit-normalised embeddings from an exported encoder, batched by token length."""

    def __init__(self, *, model: SentenceTransformer, onnx_path: Path, max_seq_length: int, threads: int) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = onnxruntime.InferenceSession(
            str(onnx_path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._tokenizer = model.tokenizer
        self._max_seq_length = max_seq_length
        self._dimension = int(model.get_embedding_dimension())
        self.name = onnx_path.name

    @property
    def dimension(self) -> int:
        return self._dimension

    def encode(
        self, texts: list[str], *, batch_size: int, progress: Callable[[int], None] | None = None
    ) -> np.ndarray:
        if not texts:
            return np.zeros((0, self._dimension), dtype=np.float32)
        token_ids = self._tokenizer(
            texts, truncation=True, max_length=self._max_seq_length, add_special_tokens=True,
            return_attention_mask=False, return_token_type_ids=False,
        )["input_ids"]
        order = np.argsort([len(ids) for ids in token_ids], kind="stable")
        pad_id = self._tokenizer.pad_token_id or 0
        output = np.empty((len(texts), self._dimension), dtype=np.float32)
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            width = max(len(token_ids[row]) for row in rows)
            input_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
            attention = np.zeros((len(rows), width), dtype=np.int64)
            for position, row in enumerate(rows):
                ids = token_ids[row]
                input_ids[position, :len(ids)] = ids
                attention[position, :len(ids)] = 1
            (vectors,) = self._session.run(None, {"input_ids": input_ids, "attention_mask": attention})
            output[rows] = vectors
            if progress is not None:
                progress(len(rows))
        return output
