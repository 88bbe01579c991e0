"""Sentence-transformers encoders, loaded offline and once per process, run by torch or ONNX Runtime.

The hub is forced offline before the library is imported so that a missing local file is an error,
never a download at run time.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from sandboxes.semantic.config import SemanticSearchConfig, SemanticSearchError

if TYPE_CHECKING:
    from collections.abc import Callable

    from sentence_transformers import SentenceTransformer

_LOCK = threading.Lock()
_ENCODERS: dict[tuple[str, int], SentenceTransformer] = {}


def _force_offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def sentence_transformer_load(path: str) -> SentenceTransformer:
    """A fresh (unshared) CPU copy of the model at ``path``: a sentence-transformers directory, or a
    distilled student (``sandboxes.semantic.student``) built from its teacher."""
    _force_offline()
    from sentence_transformers import SentenceTransformer

    from sandboxes.semantic.student import is_student, student_load

    if is_student(path):
        return student_load(path)
    if not (Path(path) / "modules.json").is_file() and not (Path(path) / "config.json").is_file():
        raise SemanticSearchError(
            f"{path} holds no sentence-transformers model (no modules.json or config.json); "
            "set SEMANTIC_ENCODER to a model directory"
        )
    return SentenceTransformer(str(Path(path).resolve()), device="cpu", local_files_only=True)


def load_encoder(*, path: str, max_seq_length: int) -> SentenceTransformer:
    """The model at ``path`` on CPU (shared by every caller in this process)."""
    key = (str(Path(path).resolve()), max_seq_length)
    with _LOCK:
        encoder = _ENCODERS.get(key)
        if encoder is None:
            encoder = sentence_transformer_load(key[0])
            encoder.max_seq_length = max_seq_length
            encoder.eval()
            _ENCODERS[key] = encoder
        return encoder


def encoder_fingerprint(path: str) -> str:
    """Changes whenever the weights at ``path`` change, so an index never mixes two encoders."""
    root = Path(path).resolve()
    digest = hashlib.sha256(str(root).encode())
    for weights in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")):
        stat = weights.stat()
        digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def embedding_dimension(encoder: SentenceTransformer) -> int:
    """The encoder's vector size (sentence-transformers returns None for a model that does not state it)."""
    dimension = encoder.get_embedding_dimension()
    if dimension is None:
        raise SemanticSearchError("the encoder does not state its embedding dimension")
    return int(dimension)


def encode_texts(*, encoder: SentenceTransformer, texts: list[str], batch_size: int) -> np.ndarray:
    """Unit-normalised float32 embeddings, one row per text (cosine similarity is a dot product)."""
    if not texts:
        return np.zeros((0, embedding_dimension(encoder)), dtype=np.float32)
    vectors = encoder.encode(
        texts, batch_size=batch_size, convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False
    )
    return np.ascontiguousarray(vectors, dtype=np.float32)


class TorchTextEncoder:
    """The reference path: sentence-transformers on torch (it sorts each call's texts by length)."""

    name = "torch"

    def __init__(self, model: SentenceTransformer) -> None:
        self.model = model

    @property
    def dimension(self) -> int:
        return embedding_dimension(self.model)

    def encode(
        self, texts: list[str], *, batch_size: int, progress: Callable[[int], None] | None = None
    ) -> np.ndarray:
        if progress is None:
            return encode_texts(encoder=self.model, texts=texts, batch_size=batch_size)
        step = batch_size * 16
        parts = []
        for start in range(0, len(texts), step):
            parts.append(encode_texts(encoder=self.model, texts=texts[start:start + step], batch_size=batch_size))
            progress(len(parts[-1]))
        return np.concatenate(parts) if parts else encode_texts(encoder=self.model, texts=[], batch_size=1)


class TextEncoder(Protocol):
    name: str

    @property
    def dimension(self) -> int: ...

    def encode(
        self, texts: list[str], *, batch_size: int, progress: Callable[[int], None] | None = None
    ) -> np.ndarray:
        """Unit-normalised float32 rows, one per text; ``progress(n)`` after every ``n`` texts done."""


_TEXT_ENCODERS: dict[tuple[str, int, str, str], TextEncoder] = {}


def encoder_tag(config: SemanticSearchConfig) -> str:
    """Names the vectors an encoder makes: weights, backend and sequence length (an index never mixes two)."""
    if config.encoder_backend == "openvino-int8":  # statically quantized: named by recipe and calibration set
        from sandboxes.semantic.openvino_encoder import model_name

        return f"{encoder_fingerprint(config.encoder_path)}-{model_name(config.max_seq_length)}"
    graph = "-fused" if config.encoder_backend.startswith("onnx") else ""  # ONNX graphs since the fused export
    return f"{encoder_fingerprint(config.encoder_path)}-{config.encoder_backend}{graph}-s{config.max_seq_length}"


BACKEND_PRECISIONS = {"torch": "f32", "onnx": "f32", "onnx-int8": "int8+f32", "torch-bf16": "bf16"}
"""What each backend computes in: int8 matrix products with the rest in f32, or bfloat16 autocast."""
ISA_DEPENDENT_BACKENDS = frozenset({"onnx-int8", "openvino-int8", "torch-bf16"})
"""Backends whose vectors depend on the CPU's kernel family (``sandboxes.semantic.cpu``); float32 backends'
vectors agree across x86 CPUs to rounding."""


def encoder_runtime(config: SemanticSearchConfig) -> dict[str, object]:
    """How ``config``'s encoder computes on this machine: backend, precision, the CPU's ISA class and flags.

    Read from the configuration and the CPU, without loading the encoder, so a search can check an index
    on disk before its encoder is ready."""
    from sandboxes.semantic.cpu import this_cpu

    if config.encoder_backend == "openvino-int8":
        from sandboxes.semantic.openvino_encoder import INFERENCE_PRECISION

        precision = f"int8+{INFERENCE_PRECISION}"
    else:
        precision = BACKEND_PRECISIONS[config.encoder_backend]
    isa, flags = this_cpu()
    return {"backend": config.encoder_backend, "precision": precision, "isa_class": isa, "cpu_flags": list(flags)}


def runtime_mismatch(*, recorded: object, current: dict[str, object]) -> str | None:
    """Why vectors ``recorded`` in an index are not comparable with the ``current`` encoder's (None: they are).

    Backend and precision must agree; the ISA class too where the backend's vectors depend on it. An index
    with no record was built before these were recorded: trusted only for a float32 backend."""
    dependent = current["backend"] in ISA_DEPENDENT_BACKENDS
    if not isinstance(recorded, dict):
        if not dependent:
            return None
        return "it records no encoder precision or CPU class (built before they were recorded)"
    fields = ("backend", "precision", "isa_class") if dependent else ("backend", "precision")
    differences = [f"{name} {recorded.get(name)!r} there, {current[name]!r} here"
                   for name in fields if recorded.get(name) != current[name]]
    return "; ".join(differences) or None


def text_encoder_load(*, config: SemanticSearchConfig) -> TextEncoder:
    """The encoder ``config`` asks for, loaded once per process; the ONNX export is cached under the index root."""
    model = load_encoder(path=config.encoder_path, max_seq_length=config.max_seq_length)
    backend = config.encoder_backend
    if backend == "torch":
        return TorchTextEncoder(model)
    cache_dir = Path(config.encoder_cache_dir) / encoder_fingerprint(config.encoder_path)
    key = (str(Path(config.encoder_path).resolve()), config.max_seq_length, backend, str(cache_dir))
    with _LOCK:
        encoder = _TEXT_ENCODERS.get(key)
    if encoder is not None:
        return encoder
    if backend == "torch-bf16":
        from sandboxes.semantic.bf16_encoder import TorchBf16TextEncoder

        encoder = TorchBf16TextEncoder(model=model, max_seq_length=config.max_seq_length)
    elif backend == "openvino-int8":
        import torch

        from sandboxes.semantic.openvino_encoder import OpenVinoTextEncoder, openvino_model_path

        encoder = OpenVinoTextEncoder(
            model=model, model_path=openvino_model_path(model=model, cache_dir=cache_dir,
                                                        max_seq_length=config.max_seq_length),
            max_seq_length=config.max_seq_length, threads=torch.get_num_threads(),
        )
    else:
        import torch

        from sandboxes.semantic.fast_encoder import OnnxTextEncoder, onnx_model_path

        onnx_path = onnx_model_path(model=model, cache_dir=cache_dir, backend=backend)
        encoder = OnnxTextEncoder(
            model=model, onnx_path=onnx_path, max_seq_length=config.max_seq_length, threads=torch.get_num_threads()
        )
    with _LOCK:
        return _TEXT_ENCODERS.setdefault(key, encoder)
