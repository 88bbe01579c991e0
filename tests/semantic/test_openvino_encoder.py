"""The statically quantized OpenVINO path: its calibration set, its int8 kernels, its cache and its threads.

Its vectors are bounded against the reference in ``test_fast_encoder.py`` (with the other backends).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from sandboxes.semantic import calibration
from sandboxes.semantic.config import SemanticSearchConfig, SemanticSearchError
from sandboxes.semantic.encoder import encoder_fingerprint, encoder_tag, load_encoder, text_encoder_load
from training.embeddings.evaluation import HELD_OUT_STDLIB_MODULES, held_out_files, retrieval_set_build


def test_the_calibration_set_never_reads_the_benchmarks_held_out_modules():
    assert not set(calibration.CALIBRATION_MODULES) & set(HELD_OUT_STDLIB_MODULES)
    texts = calibration.calibration_texts()
    assert len(texts) == calibration.CALIBRATION_TEXTS == len(set(texts))
    held_out_heads = {f"stdlib/{module}" for module in HELD_OUT_STDLIB_MODULES}
    assert not [text for text in texts if text.split("\n", 1)[0].split(" ")[0] in held_out_heads]
    queries = [text for text in texts if not text.startswith("stdlib/")]
    assert len(queries) == calibration.CALIBRATION_TEXTS // calibration.QUERY_SHARE
    assert all(3 <= len(query.split()) <= 16 for query in queries)


def test_the_calibration_set_names_its_indexes(monkeypatch, tmp_path):
    """A host whose standard library gives other calibration texts must not share indexes with this one."""
    config = SemanticSearchConfig(encoder_backend="openvino-int8", encoder_cache_dir=tmp_path)
    before = encoder_tag(config)
    assert before.endswith(f"-s{config.max_seq_length}-c{calibration.calibration_digest()}")
    changed = (*calibration.calibration_texts()[:-1], "another standard library's last line")
    monkeypatch.setattr(calibration, "calibration_texts", lambda count=calibration.CALIBRATION_TEXTS: changed)
    calibration.calibration_digest.cache_clear()
    try:
        assert encoder_tag(config) != before
    finally:
        monkeypatch.undo()
        calibration.calibration_digest.cache_clear()
    assert encoder_tag(config) == before


def test_the_quantized_graph_runs_int8_matrix_kernels(encoder_cache):
    """OpenVINO must really execute the fully connected layers in int8 (a graph NNCF failed to quantize
    would still run, in float)."""
    from sandboxes.semantic.openvino_encoder import _compile, openvino_model_path

    config = SemanticSearchConfig(encoder_cache_dir=encoder_cache, encoder_backend="openvino-int8")
    model = load_encoder(path=config.encoder_path, max_seq_length=config.max_seq_length)
    path = openvino_model_path(model=model, cache_dir=encoder_cache / encoder_fingerprint(config.encoder_path),
                               max_seq_length=config.max_seq_length)
    runtime = _compile(path, threads=1).get_runtime_model()
    layers = [(op.get_rt_info()["layerType"].astype(str), op.get_rt_info()["runtimePrecision"].astype(str))
              for op in runtime.get_ordered_ops()]
    products = [precision.lower() for layer, precision in layers if layer.startswith("FullyConnected")]
    # q, k, v, attention output, up and down: 36 in six layers; NNCF may leave one or two in float.
    assert products.count("u8") + products.count("i8") >= 30, products


AMX_XEON_CAPABILITIES = ("FP32", "BF16", "FP16", "INT8", "BIN", "EXPORT_IMPORT")
"""OpenVINO's OPTIMIZATION_CAPABILITIES on an Intel Xeon with AMX (bfloat16 and float16 natively)."""
AVX2_CAPABILITIES = ("FP32", "INT8", "BIN", "EXPORT_IMPORT")


@pytest.mark.parametrize("capabilities", [AMX_XEON_CAPABILITIES, AVX2_CAPABILITIES])
def test_the_unquantized_ops_are_asked_for_float32_whatever_the_cpu_offers(capabilities):
    """Where the CPU had bfloat16 the encoder asked for it: each batch shape then got its own bf16/AMX kernels
    and one text's vector moved with its batch (cosine 0.835 to itself on an AMX Xeon). The CPU plugin picks
    bf16 on such CPUs when no precision is given, so f32 must be asked for explicitly, in accuracy mode."""
    from sandboxes.semantic.openvino_encoder import compile_properties

    properties = compile_properties(threads=2, capabilities=capabilities)
    assert properties["INFERENCE_PRECISION_HINT"] == "f32", properties
    assert properties["EXECUTION_MODE_HINT"] == "ACCURACY", properties


def test_the_compiled_model_computes_in_float32_and_int8_only(encoder_cache):
    """What OpenVINO really compiled on this machine: f32 inference precision, no bfloat16 or float16 layer."""
    from sandboxes.semantic.openvino_encoder import _compile, openvino_model_path

    config = SemanticSearchConfig(encoder_cache_dir=encoder_cache, encoder_backend="openvino-int8")
    model = load_encoder(path=config.encoder_path, max_seq_length=config.max_seq_length)
    path = openvino_model_path(model=model, cache_dir=encoder_cache / encoder_fingerprint(config.encoder_path),
                               max_seq_length=config.max_seq_length)
    compiled = _compile(path, threads=1)
    assert compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name() == "f32"
    assert str(compiled.get_property("EXECUTION_MODE_HINT")).endswith("ACCURACY")
    precisions = {op.get_rt_info()["runtimePrecision"].astype(str).lower()
                  for op in compiled.get_runtime_model().get_ordered_ops()}
    assert not precisions & {"bf16", "f16"}, sorted(precisions)


def test_a_failed_quantization_leaves_nothing_a_later_process_could_load(tmp_path, monkeypatch):
    from sandboxes.semantic import openvino_encoder

    model = load_encoder(path=SemanticSearchConfig().encoder_path, max_seq_length=64)

    def half_written(*, destination, **_):
        destination.parent.mkdir(parents=True)
        destination.write_text("<net>")
        raise RuntimeError("killed while saving")

    monkeypatch.setattr(openvino_encoder, "_quantize", half_written)
    with pytest.raises(RuntimeError, match="killed while saving"):
        openvino_encoder.openvino_model_path(model=model, cache_dir=tmp_path, max_seq_length=64)
    assert not [path.name for path in tmp_path.iterdir() if "openvino-int8" in path.name]


def test_threads_encoding_at_once_get_their_own_vectors(tmp_path, encoder_cache):
    """An index build and a query encode on one shared encoder at the same time."""
    config = SemanticSearchConfig(index_root=tmp_path / "index", vector_store="memory",
                                  encoder_cache_dir=encoder_cache, encoder_backend="openvino-int8")
    encoder = text_encoder_load(config=config)
    chunks = [chunk.embedding_text() for chunk in retrieval_set_build(
        files=held_out_files(("heapq.py",)), max_queries=4, seed=0).chunks]
    queries = ["merge sorted inputs", "push an item onto the heap", "x"]
    alone = encoder.encode(chunks, batch_size=4), encoder.encode(queries, batch_size=1)
    results: dict[str, np.ndarray] = {}
    errors: list[BaseException] = []

    def run(name: str, texts: list[str], batch: int) -> None:
        try:
            for _ in range(3):
                results[name] = encoder.encode(texts, batch_size=batch)
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=run, args=("chunks", chunks, 4)),
               threading.Thread(target=run, args=("queries", queries, 1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and not any(thread.is_alive() for thread in threads)
    np.testing.assert_allclose(results["chunks"], alone[0], atol=1e-5)
    np.testing.assert_allclose(results["queries"], alone[1], atol=1e-5)


def test_an_encode_interrupted_by_its_progress_callback_leaves_the_encoder_usable(tmp_path, encoder_cache):
    """A cancelled build stops from its progress callback; requests still in flight must not stay busy."""
    config = SemanticSearchConfig(index_root=tmp_path / "index", vector_store="memory",
                                  encoder_cache_dir=encoder_cache, encoder_backend="openvino-int8")
    encoder = text_encoder_load(config=config)
    texts = [f"def function_{number}(value):\n    return value + {number}" for number in range(80)]

    def cancel(_: int) -> None:
        raise InterruptedError("build cancelled")

    with pytest.raises(InterruptedError):
        encoder.encode(texts, batch_size=4, progress=cancel)
    again = encoder.encode(texts, batch_size=4)
    np.testing.assert_allclose(np.linalg.norm(again, axis=1), 1.0, atol=1e-4)
    np.testing.assert_allclose(again[:3], encoder.encode(texts[:3], batch_size=1), atol=1e-2)


def test_unknown_backends_are_refused_with_the_choices():
    with pytest.raises(SemanticSearchError, match="openvino-int8"):
        SemanticSearchConfig(encoder_backend="openvino")
