"""The statically quantized indexing path: the same encoder, int8 by NNCF, run by OpenVINO.

The eager ONNX export of ``fast_encoder`` (pooling and normalisation included) is read by OpenVINO and
quantized once per (weights, sequence length, calibration set) with NNCF's post-training quantization
for transformers (SmoothQuant, mixed preset: symmetric int8 weights, asymmetric activations, fast bias
correction), its activation ranges measured on the fixed calibration set of
``sandboxes.semantic.calibration``; what NNCF leaves unquantized runs in f32 on every CPU, so a text's
vector does not depend on the batch it is encoded in (in bfloat16 it did, on CPUs that have it).
Static ranges let OpenVINO chain int8 matrix products (oneDNN's VNNI kernels) without the per-call
quantization of ONNX Runtime's dynamic path, and batches run on one single-threaded stream per core.

Measured on this repository's 2-core AMD EPYC (docs/notebook/2026-12-03-issue-53.md): ~1.5x the ONNX
Runtime int8 path at the same sequence length, vectors closer to fp32 (cosine min 0.994 vs 0.987 on 256 of
the benchmark's chunks). ``tests/semantic/test_fast_encoder.py`` bounds its vectors like the other
int8 path; the retrieval benchmark re-measures recall with it.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from filelock import FileLock

from sandboxes.semantic.calibration import calibration_digest, calibration_texts
from sandboxes.semantic.encoder import embedding_dimension
from sandboxes.semantic.fast_encoder import length_sorted_batches, onnx_model_path

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from sentence_transformers import SentenceTransformer

MODEL_FILE = "model.xml"
RECIPE = "transformer-mixed"
"""How the model is quantized (NNCF's transformer model type, mixed preset); it names the model and its
indexes, so a change of recipe can never mix two models' vectors in one index. The performance preset
(symmetric activations) indexed no faster in the same rounds (266 vs 259 chunks/s) and moved the vectors
more (cosine min 0.972 vs 0.977), so it was not taken (2026-12-03)."""
INFERENCE_PRECISION = "f32"
"""Precision of the ops NNCF leaves unquantized, on every CPU (``compile_properties``); it is part of the index's
record of how its vectors were made (``sandboxes.semantic.index``)."""
WIDTH_MULTIPLE = 8
"""Batches pad to a multiple of this many word pieces: OpenVINO reuses the kernels it prepared for a shape it
has seen, so a search's one-query batches hit (query p50 4.5 ms against 6.4 ms unrounded, 2026-12-03), at no
measured indexing cost."""
REQUESTS_PER_STREAM = 2
"""Requests in flight per stream: with two per stream the 2-core machine indexed 297 chunks/s against 280
with one (six interleaved rounds, 10.4x vs 10.0x the reference; OpenVINO's own suggestion is one per stream)."""
ROWS_PER_REQUEST = 16
"""At most this many texts per inference request: 16 rows indexed at least as fast as 32 in every round
measured; 8 and 24 were within noise of 16 (docs/notebook/2026-12-03-issue-53.md)."""


def model_name(max_seq_length: int) -> str:
    """Names the quantized model: recipe, sequence length (the calibration's truncation) and calibration set."""
    return f"openvino-int8-{RECIPE}-s{max_seq_length}-c{calibration_digest()}"


def openvino_model_path(*, model: SentenceTransformer, cache_dir: Path, max_seq_length: int) -> Path:
    """The quantized model (``model.xml`` + ``model.bin``) under ``cache_dir``, made once across processes."""
    target = cache_dir / model_name(max_seq_length)
    if (target / MODEL_FILE).is_file():
        return target / MODEL_FILE
    exported = onnx_model_path(model=model, cache_dir=cache_dir, backend="onnx", fused=False)
    with FileLock(str(cache_dir / "openvino.lock")):
        if not (target / MODEL_FILE).is_file():
            staging = cache_dir / f".{target.name}.{uuid.uuid4().hex}"
            try:
                _quantize(model=model, source=exported, destination=staging / MODEL_FILE,
                          max_seq_length=max_seq_length)
                os.replace(staging, target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target / MODEL_FILE


def _quantize(*, model: SentenceTransformer, source: Path, destination: Path, max_seq_length: int) -> None:
    import nncf
    import openvino

    nncf.set_log_level(logging.ERROR)
    samples = [{"input_ids": ids, "attention_mask": attention} for _, ids, attention in length_sorted_batches(
        tokenizer=model.tokenizer, texts=list(calibration_texts()), max_seq_length=max_seq_length, batch_size=1)]
    quantized = nncf.quantize(openvino.Core().read_model(str(source)), nncf.Dataset(samples),
                              model_type=nncf.ModelType.TRANSFORMER, preset=nncf.QuantizationPreset.MIXED,
                              subset_size=len(samples))
    destination.parent.mkdir(parents=True)
    openvino.save_model(quantized, str(destination))


def compile_properties(*, threads: int, capabilities: Sequence[str]) -> dict[str, Any]:
    """The CPU plugin's properties for ``threads`` streams on a CPU offering ``capabilities``
    (OpenVINO's OPTIMIZATION_CAPABILITIES): the same on every CPU.

    What NNCF left unquantized runs in f32 even where the CPU has bfloat16 (``BF16`` in ``capabilities``):
    in bf16 each batch shape gets its own bf16/AMX kernels, so one text's vector depended on the batch it was
    encoded in and an index's vectors on the machine. The CPU plugin picks bf16 on such CPUs when no
    precision is given, so f32 is asked for explicitly; accuracy mode also keeps the plugin from quantizing
    float matrix products' inputs on the fly."""
    del capabilities  # a parameter so that tests can pass another CPU's: none of them may change the properties
    return {"PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": threads, "INFERENCE_NUM_THREADS": threads,
            "INFERENCE_PRECISION_HINT": INFERENCE_PRECISION, "EXECUTION_MODE_HINT": "ACCURACY"}


def _compile(path: Path, *, threads: int) -> Any:
    import openvino

    core = openvino.Core()
    properties = compile_properties(threads=threads,
                                    capabilities=core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    return core.compile_model(core.read_model(str(path)), "CPU", properties)


class OpenVinoTextEncoder:
    """Unit-normalised embeddings from the quantized encoder, batched by token length, one stream per core."""

    def __init__(self, *, model: SentenceTransformer, model_path: Path, max_seq_length: int, threads: int) -> None:
        self._compiled = _compile(model_path, threads=max(1, threads))
        self._streams = max(1, threads)
        self._local = threading.local()
        self._tokenizer = model.tokenizer
        self._max_seq_length = max_seq_length
        self._dimension = embedding_dimension(model)
        self.name = f"openvino-int8:{model_path.parent.name}"

    @property
    def dimension(self) -> int:
        return self._dimension

    def _requests(self) -> list[Any]:
        """This thread's requests (an index build and a query may encode at once): ``REQUESTS_PER_STREAM``
        per stream, so a stream has its next batch queued while this thread copies out the last one."""
        requests = getattr(self._local, "requests", None)
        if requests is None:
            requests = self._local.requests = [self._compiled.create_infer_request()
                                               for _ in range(REQUESTS_PER_STREAM * self._streams)]
        return requests

    def encode(
        self, texts: list[str], *, batch_size: int, progress: Callable[[int], None] | None = None
    ) -> np.ndarray:
        """Batches go round the requests; a request's rows are copied out (in this thread) before it is reused."""
        output = np.empty((len(texts), self._dimension), dtype=np.float32)
        requests = self._requests()
        pending: deque[tuple[Any, np.ndarray]] = deque()
        batches = length_sorted_batches(tokenizer=self._tokenizer, texts=texts, max_seq_length=self._max_seq_length,
                                        batch_size=min(batch_size, ROWS_PER_REQUEST), width_multiple=WIDTH_MULTIPLE)
        try:
            for index, (rows, input_ids, attention) in enumerate(batches):
                if len(pending) == len(requests):
                    _collect(pending.popleft(), output, progress)
                request = requests[index % len(requests)]
                request.start_async({"input_ids": input_ids, "attention_mask": attention})
                pending.append((request, rows))
            while pending:
                _collect(pending.popleft(), output, progress)
        finally:
            for request, _ in pending:  # interrupted (a progress callback raised): leave no request busy
                request.wait()
        return output


def _collect(flight: tuple[Any, np.ndarray], output: np.ndarray, progress: Callable[[int], None] | None) -> None:
    request, rows = flight
    request.wait()
    output[rows] = request.get_output_tensor(0).data
    if progress is not None:
        progress(len(rows))
