"""Sentence-transformers encoders, loaded offline and once per process.

The hub is forced offline before the library is imported so that a missing local file is an error,
never a download at run time.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sandboxes.semantic.config import SemanticSearchError

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

_LOCK = threading.Lock()
_ENCODERS: dict[tuple[str, int], SentenceTransformer] = {}


def _force_offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def load_encoder(*, path: str, max_seq_length: int) -> SentenceTransformer:
    """The model at ``path`` on CPU (shared by every caller in this process)."""
    key = (str(Path(path).resolve()), max_seq_length)
    with _LOCK:
        encoder = _ENCODERS.get(key)
        if encoder is None:
            _force_offline()
            from sentence_transformers import SentenceTransformer

            if not (Path(path) / "modules.json").is_file() and not (Path(path) / "config.json").is_file():
                raise SemanticSearchError(
                    f"{path} holds no sentence-transformers model (no modules.json or config.json); "
                    "set SEMANTIC_ENCODER to a model directory"
                )
            encoder = SentenceTransformer(key[0], device="cpu", local_files_only=True)
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


def encode_texts(*, encoder: SentenceTransformer, texts: list[str], batch_size: int) -> np.ndarray:
    """Unit-normalised float32 embeddings, one row per text (cosine similarity is a dot product)."""
    if not texts:
        dimension = encoder.get_embedding_dimension()
        return np.zeros((0, dimension), dtype=np.float32)
    vectors = encoder.encode(
        texts, batch_size=batch_size, convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False
    )
    return np.ascontiguousarray(vectors, dtype=np.float32)
