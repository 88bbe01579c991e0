"""The indexing fast paths (ONNX Runtime and OpenVINO, length-sorted batches, int8) against the reference path.

The fixed sample is the first 96 chunks of the retrieval benchmark's held-out set (stdlib code with
its docstrings removed) plus a few short queries, all encoded at the index's sequence length. The
bounds are the stated contract: fp32 ONNX reproduces sentence-transformers to rounding; int8 moves
each vector by at most 1 - ``INT8_MIN_COSINE`` (its recall is re-measured in bench_retrieval.py). They
hold for the bundled MiniLM, for a distilled student of it (``distill_encoder``) and for fine-tuned
checkpoints (``train_embeddings``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sandboxes.semantic.config import SemanticSearchConfig, SemanticSearchError
from sandboxes.semantic.encoder import encoder_tag, load_encoder, text_encoder_load
from training.embeddings.evaluation import held_out_files, retrieval_set_build

FP32_MIN_COSINE = 0.9999
INT8_MIN_COSINE = 0.97
INT8_MEAN_COSINE = 0.99
BF16_MIN_COSINE = 0.999
BF16_MEAN_COSINE = 0.9999


@pytest.fixture(scope="module")
def sample_texts() -> list[str]:
    retrieval_set = retrieval_set_build(files=held_out_files(("textwrap.py", "csv.py", "heapq.py")), max_queries=20,
                                        seed=0)
    texts = [chunk.embedding_text() for chunk in retrieval_set.chunks[:96]]
    return texts + [query.text for query in retrieval_set.queries[:8]] + ["x", "parse a duration like 5m"]


def _config(tmp_path, encoder_cache, backend: str, encoder: str | None = None) -> SemanticSearchConfig:
    config = SemanticSearchConfig(index_root=tmp_path / "index", vector_store="memory", encoder_cache_dir=encoder_cache,
                                  encoder_backend=backend)
    return replace(config, encoder_path=encoder) if encoder else config





def _cosines(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    return np.sum(first * second, axis=1) / (np.linalg.norm(first, axis=1) * np.linalg.norm(second, axis=1))


BOUNDS = [("onnx", FP32_MIN_COSINE, FP32_MIN_COSINE), ("onnx-int8", INT8_MIN_COSINE, INT8_MEAN_COSINE),
          ("torch-bf16", BF16_MIN_COSINE, BF16_MEAN_COSINE), ("openvino-int8", INT8_MIN_COSINE, INT8_MEAN_COSINE)]
TRAINED_CHECKPOINT = Path("var/embeddings/code-search")
"""Where ``manage.py train_embeddings`` puts the fine-tuned encoder (not shipped; checked when present)."""


def _assert_fast_path_within_bound(*, config: SemanticSearchConfig, texts: list[str], backend: str,
                                   min_cosine: float, mean_cosine: float) -> np.ndarray:
    reference = text_encoder_load(config=replace(config, encoder_backend="torch"))
    fast = text_encoder_load(config=replace(config, encoder_backend=backend))
    expected = reference.encode(texts, batch_size=16)
    got = fast.encode(texts, batch_size=16)
    assert got.shape == expected.shape == (len(texts), 384) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)
    cosines = _cosines(got, expected)
    assert cosines.min() >= min_cosine, (config.encoder_path, backend, float(cosines.min()))
    assert cosines.mean() >= mean_cosine, (config.encoder_path, backend, float(cosines.mean()))
    return expected


@pytest.mark.parametrize(("backend", "min_cosine", "mean_cosine"), BOUNDS)
def test_fast_path_vectors_match_the_reference_within_the_bound(
    tmp_path, encoder_cache, sample_texts, backend, min_cosine, mean_cosine
):
    _assert_fast_path_within_bound(config=_config(tmp_path, encoder_cache, "torch"), texts=sample_texts,
                                   backend=backend, min_cosine=min_cosine, mean_cosine=mean_cosine)


@pytest.fixture(scope="module")
def student_checkpoint(tmp_path_factory) -> Path:
    """A distilled student (two of the six layers, a short real run), saved in the student format."""
    from tests.semantic.test_embeddings import write_library
    from training.embeddings.distill import EncoderDistillConfig, embeddings_distill

    root = tmp_path_factory.mktemp("student")
    library = write_library(root / "src", copies=12)
    result = embeddings_distill(config=EncoderDistillConfig(
        output_dir=root / "student", layers=(0, 5), source_roots=(str(library),), pairs=16, chunks=16, batch_size=8,
        epochs=1, max_seq_length=64, torch_threads=1))
    return result.output_dir


@pytest.mark.parametrize(("backend", "min_cosine", "mean_cosine"), BOUNDS)
def test_the_bound_holds_for_a_distilled_student(
    tmp_path, encoder_cache, sample_texts, student_checkpoint, backend, min_cosine, mean_cosine
):
    """The fast path exports a student built from its teacher and trained layers like any checkpoint."""
    config = replace(_config(tmp_path, encoder_cache, "torch"), encoder_path=str(student_checkpoint))
    _assert_fast_path_within_bound(config=config, texts=sample_texts, backend=backend,
                                   min_cosine=min_cosine, mean_cosine=mean_cosine)


@pytest.fixture(scope="module")
def finetuned_checkpoint(tmp_path_factory) -> Path:
    """A ``train_embeddings`` checkpoint: a short run at a high learning rate, so its weights really moved."""
    from tests.semantic.test_embeddings import write_library
    from training.embeddings.finetune import EmbeddingFinetuneConfig, embeddings_finetune

    root = tmp_path_factory.mktemp("finetuned")
    library = write_library(root / "src", copies=8)
    result = embeddings_finetune(config=EmbeddingFinetuneConfig(
        output_dir=root / "encoder", source_roots=(str(library),), max_pairs=48, batch_size=8, learning_rate=2e-4,
        max_seq_length=64, torch_threads=1))
    return result.output_dir


@pytest.mark.parametrize(("backend", "min_cosine", "mean_cosine"), BOUNDS)
def test_the_bound_holds_for_a_finetuned_encoder_too(
    tmp_path, encoder_cache, sample_texts, finetuned_checkpoint, backend, min_cosine, mean_cosine
):
    """The fast path exports whatever checkpoint SEMANTIC_ENCODER names; a fine-tune keeps within the bound."""
    base = text_encoder_load(config=_config(tmp_path, encoder_cache, "torch")).encode(sample_texts, batch_size=16)
    config = replace(_config(tmp_path, encoder_cache, "torch"), encoder_path=str(finetuned_checkpoint))
    tuned = _assert_fast_path_within_bound(config=config, texts=sample_texts, backend=backend,
                                           min_cosine=min_cosine, mean_cosine=mean_cosine)
    assert _cosines(tuned, base).min() < 0.99, "the fine-tune must have moved the vectors"


@pytest.mark.skipif(not (TRAINED_CHECKPOINT / "modules.json").is_file(),
                    reason="no train_embeddings checkpoint at var/embeddings/code-search")
@pytest.mark.parametrize(("backend", "min_cosine", "mean_cosine"), BOUNDS)
def test_the_bound_holds_for_the_trained_code_search_encoder(
    tmp_path, encoder_cache, sample_texts, backend, min_cosine, mean_cosine
):
    config = replace(_config(tmp_path, encoder_cache, "torch"), encoder_path=str(TRAINED_CHECKPOINT.resolve()))
    _assert_fast_path_within_bound(config=config, texts=sample_texts, backend=backend,
                                   min_cosine=min_cosine, mean_cosine=mean_cosine)


SAME_TEXT_ATOL = 1e-3
SAME_TEXT_MIN_COSINE = 0.9999
"""The stated bound on the index paths: one text's vector, whatever batch, order or padding it was encoded with."""
INVARIANCE = [("torch", 1e-5, 0.99999), ("onnx", 2e-5, 0.99999), ("openvino-int8", SAME_TEXT_ATOL, SAME_TEXT_MIN_COSINE),
              ("torch-bf16", 1e-2, 0.999)]
"""torch-bf16 (opt-in) computes in bfloat16, which rounds differently in differently shaped batches: its own,
wider bound. The default path computes its unquantized ops in f32 on every CPU and is held to the stated one."""


def _same_text_encodings(fast, texts: list[str]) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Each text's vector in batches of 7, then {how: (rows, their vectors)} from differently composed batches:
    all texts in batches of 32 (requests of at most 16 rows on OpenVINO), shuffled; every eighth chunk and the
    short texts at the end alone, and padded to the longest text's width."""
    permutation = np.random.default_rng(0).permutation(len(texts))
    longest = max(texts, key=len)
    singles = np.array(sorted({*range(0, len(texts), 8), *range(len(texts) - 10, len(texts))}))
    shuffled = fast.encode([texts[i] for i in permutation], batch_size=32)[np.argsort(permutation)]
    return fast.encode(texts, batch_size=7), {
        "batches of 32, shuffled": (np.arange(len(texts)), shuffled),
        "alone": (singles, np.stack([fast.encode([texts[row]], batch_size=1)[0] for row in singles])),
        "beside the longest text": (singles, np.stack([fast.encode([texts[row], longest], batch_size=2)[0]
                                                       for row in singles])),
    }


@pytest.mark.parametrize(("backend", "atol", "min_cosine"), INVARIANCE)
def test_the_same_text_gets_the_same_vector_in_any_batch(tmp_path, encoder_cache, sample_texts, backend, atol,
                                                         min_cosine):
    """Batch size, order and padding must not move a vector (a row swapped with another would be off by far
    more): the index's chunks and a search's one-query batches must meet in one space."""
    fast = text_encoder_load(config=_config(tmp_path, encoder_cache, backend))
    reference, encodings = _same_text_encodings(fast, sample_texts)
    for name, (rows, vectors) in encodings.items():
        difference = float(np.abs(vectors - reference[rows]).max())
        cosine = float(_cosines(vectors, reference[rows]).min())
        assert difference <= atol and cosine >= min_cosine, (backend, name, difference, cosine)
    assert fast.encode([], batch_size=4).shape == (0, 384)
    if backend != "torch":  # the reference reports progress every 16 batches
        reported = []
        fast.encode(sample_texts, batch_size=10, progress=reported.append)
        assert sum(reported) == len(sample_texts) and len(reported) == int(np.ceil(len(sample_texts) / 10))


def test_backends_and_sequence_lengths_name_different_indexes(tmp_path, encoder_cache):
    base = _config(tmp_path, encoder_cache, "torch")
    tags = {encoder_tag(replace(base, encoder_backend=backend, max_seq_length=length))
            for backend in ("torch", "torch-bf16", "onnx", "onnx-int8", "openvino-int8") for length in (96, 256)}
    assert len(tags) == 10
    with pytest.raises(SemanticSearchError, match="encoder_backend"):
        replace(base, encoder_backend="tensorrt")


def test_models_the_export_cannot_reproduce_are_refused(tmp_path, encoder_cache):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling

    from sandboxes.semantic.fast_encoder import onnx_model_path

    model = load_encoder(path=SemanticSearchConfig().encoder_path, max_seq_length=128)
    cls_pooled = SentenceTransformer(modules=[model[0], Pooling(384, pooling_mode="cls")], device="cpu")
    with pytest.raises(SemanticSearchError, match="mean pooling"):
        onnx_model_path(model=cls_pooled, cache_dir=tmp_path / "cls", backend="onnx")
    assert not list((tmp_path / "cls").glob("*.onnx"))


@pytest.mark.parametrize(("backend", "attention"), [("onnx", "Attention"), ("onnx-int8", "QAttention")])
def test_the_fast_graph_runs_fused_transformer_kernels(encoder_cache, backend, attention):
    """The export must keep matching ORT's fusion patterns (a transformers upgrade can silently break them)."""
    import onnx

    from sandboxes.semantic.encoder import encoder_fingerprint
    from sandboxes.semantic.fast_encoder import onnx_model_path

    config = SemanticSearchConfig(encoder_cache_dir=encoder_cache, encoder_backend=backend, max_seq_length=128)
    model = load_encoder(path=config.encoder_path, max_seq_length=128)
    path = onnx_model_path(model=model, cache_dir=encoder_cache / encoder_fingerprint(config.encoder_path),
                           backend=backend)
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert {attention, "SkipLayerNormalization", "BiasGelu"} <= ops, sorted(ops)
    assert "Softmax" not in ops  # no unfused attention left
