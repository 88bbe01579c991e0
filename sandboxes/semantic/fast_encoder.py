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
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from filelock import FileLock

from sandboxes.semantic.config import SemanticSearchError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from sentence_transformers import SentenceTransformer

ONNX_BACKENDS = ("onnx", "onnx-int8")
_TOKENIZER_LOCK = threading.Lock()
_EXPORT_OPSET = 17


def pipeline_stage(model: SentenceTransformer, index: int) -> Any:
    """``model[index]``: a sentence-transformers pipeline stage (its indexing is typed as Module | Tensor)."""
    return model[index]


def _check_architecture(model: SentenceTransformer) -> None:
    """The export reproduces Transformer -> mean Pooling -> Normalize only; anything else is refused."""
    names = [type(module).__name__ for module in model]
    if names[:2] != ["Transformer", "Pooling"] or any(name not in ("Transformer", "Pooling", "Normalize") for name in names):
        raise SemanticSearchError(
            f"the ONNX encoder backend supports Transformer + Pooling (+ Normalize) models, not {names}; "
            "set SEMANTIC_ENCODER_BACKEND=torch for this model"
        )
    pooling = pipeline_stage(model, 1).get_config_dict()
    mode = pooling.get("pooling_mode") or ("mean" if pooling.get("pooling_mode_mean_tokens") else "other")
    if mode != "mean" or not pooling.get("include_prompt", True):
        raise SemanticSearchError(
            f"the ONNX encoder backend supports mean pooling over every token, not {pooling}; "
            "set SEMANTIC_ENCODER_BACKEND=torch for this model"
        )


def _export(*, model: SentenceTransformer, destination: Path) -> None:
    import torch

    transformer = pipeline_stage(model, 0).auto_model

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
    # Eager attention exports the classic additive-mask pattern that ONNX Runtime's transformer
    # optimizer fuses into its Attention kernel (the sdpa export's masking is not recognised).
    attention = transformer.config._attn_implementation
    transformer.set_attn_implementation("eager")
    try:
        _export_pooled(Pooled().eval(), sample=sample, destination=destination)
    finally:
        transformer.set_attn_implementation(attention)


def _export_pooled(module, *, sample, destination: Path) -> None:
    import torch

    with torch.inference_mode():
        torch.onnx.export(
            module,
            (sample["input_ids"], sample["attention_mask"]),
            str(destination),
            input_names=["input_ids", "attention_mask"],
            output_names=["embedding"],
            dynamic_axes={"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"},
                          "embedding": {0: "batch"}},
            opset_version=_EXPORT_OPSET,
            dynamo=False,
        )


def _fuse(*, source: Path, destination: Path, model: SentenceTransformer) -> None:
    """ONNX Runtime's transformer optimizer: fused attention, LayerNorm (+ residual) and GELU kernels."""
    from onnxruntime.transformers.optimizer import optimize_model

    config = pipeline_stage(model, 0).auto_model.config
    optimized = optimize_model(str(source), model_type="bert", num_heads=int(config.num_attention_heads),
                               hidden_size=int(config.hidden_size), opt_level=1, use_gpu=False)
    optimized.save_model_to_file(str(destination))


def _quantize(*, source: Path, destination: Path) -> None:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # The fused graph's contrib ops (Attention, SkipLayerNormalization, ...) leave some MatMul outputs
    # without an inferred type; every activation here is float32.
    quantize_dynamic(str(source), str(destination), weight_type=QuantType.QInt8, per_channel=True,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})


def onnx_model_path(*, model: SentenceTransformer, cache_dir: Path, backend: str, fused: bool = True) -> Path:
    """The exported (fused, and for ``onnx-int8`` quantized) model under ``cache_dir``, made once across processes."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    stem = "model.fused" if fused else "model.eager"
    target = cache_dir / (f"{stem}.int8.onnx" if backend == "onnx-int8" else f"{stem}.onnx")
    if target.is_file():
        return target
    with FileLock(str(cache_dir / "export.lock")):
        if target.is_file():
            return target
        _check_architecture(model)
        exported = cache_dir / "model.eager.onnx"
        if not exported.is_file():
            staging = cache_dir / f".model.{uuid.uuid4().hex}.onnx"
            _export(model=model, destination=staging)
            os.replace(staging, exported)
        graph = exported
        if fused:
            graph = cache_dir / "model.fused.onnx"
            if not graph.is_file():
                _staged(graph, lambda staging: _fuse(source=exported, destination=staging, model=model))
        if backend == "onnx-int8":
            _staged(target, lambda staging: _quantize(source=graph, destination=staging))
    return target


def _staged(target: Path, make: Callable[[Path], None]) -> None:
    """``make`` writes a staging file that replaces ``target`` only once complete."""
    staging = target.with_name(f".{target.stem}.{uuid.uuid4().hex}.onnx")
    try:
        make(staging)
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)


class OnnxTextEncoder:
    """Unit-normalised embeddings from an exported encoder, batched by token length."""

    def __init__(
        self, *, model: SentenceTransformer, onnx_path: Path, max_seq_length: int, threads: int, spinning: bool = False
    ) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        # Threads sleep between kernels unless told to spin: on a shared, oversubscribed machine spinning
        # burns the cores the other threads need (bench_index_speed.py, docs/notebook/2026-11-29b-issue-53.md).
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = onnxruntime.InferenceSession(
            str(onnx_path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._tokenizer = model.tokenizer
        self._max_seq_length = max_seq_length
        dimension = model.get_embedding_dimension()
        if dimension is None:
            raise SemanticSearchError(f"the encoder at {onnx_path.parent} does not state its embedding dimension")
        self._dimension = int(dimension)
        self.name = onnx_path.name

    @property
    def dimension(self) -> int:
        return self._dimension

    def encode(
        self, texts: list[str], *, batch_size: int, progress: Callable[[int], None] | None = None
    ) -> np.ndarray:
        def run(input_ids: np.ndarray, attention: np.ndarray) -> np.ndarray:
            (vectors,) = self._session.run(None, {"input_ids": input_ids, "attention_mask": attention})
            return vectors

        return encode_length_batched(tokenizer=self._tokenizer, texts=texts, max_seq_length=self._max_seq_length,
                                     batch_size=batch_size, dimension=self._dimension, run=run, progress=progress)


def encode_length_batched(
    *, tokenizer: Any, texts: list[str], max_seq_length: int, batch_size: int, dimension: int,
    run: Callable[[np.ndarray, np.ndarray], np.ndarray], progress: Callable[[int], None] | None,
) -> np.ndarray:
    """Rows of ``run(input ids, attention mask)`` over ``length_sorted_batches``, back in input order."""
    output = np.empty((len(texts), dimension), dtype=np.float32)
    for rows, input_ids, attention in length_sorted_batches(
        tokenizer=tokenizer, texts=texts, max_seq_length=max_seq_length, batch_size=batch_size
    ):
        output[rows] = run(input_ids, attention)
        if progress is not None:
            progress(len(rows))
    return output


def length_sorted_batches(
    *, tokenizer: Any, texts: list[str], max_seq_length: int, batch_size: int, width_multiple: int = 1
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(rows, input ids, attention mask) per batch: texts tokenized once, sorted by length, each batch
    padded to its own longest text only (rounded up to ``width_multiple``), never to ``max_seq_length``."""
    if not texts:
        return
    with _TOKENIZER_LOCK:  # a fast tokenizer sets its truncation on each call: one caller at a time
        token_ids = tokenizer(
            texts, truncation=True, max_length=max_seq_length, add_special_tokens=True,
            return_attention_mask=False, return_token_type_ids=False,
        )["input_ids"]
    order = np.argsort([len(ids) for ids in token_ids], kind="stable")
    pad_id = tokenizer.pad_token_id or 0
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        width = max(len(token_ids[row]) for row in rows)
        width = min(-(-width // width_multiple) * width_multiple, max(width, max_seq_length))
        input_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
        attention = np.zeros((len(rows), width), dtype=np.int64)
        for position, row in enumerate(rows):
            ids = token_ids[row]
            input_ids[position, :len(ids)] = ids
            attention[position, :len(ids)] = 1
        yield rows, input_ids, attention
