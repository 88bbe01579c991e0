"""Indexing speed of encoder variants against the reference path, back to back in one run.

The machine is shared, so only ratios taken in the same run mean anything: every round times the
reference (the bundled six-layer MiniLM on sentence-transformers/torch, 256 word pieces, batches of 32:
the index before issue 53) and each variant (the bundled MiniLM too unless --encoder) on the
same fixed sample of the retrieval benchmark's chunks, rotating the order each round; the figure is
the median over rounds of each variant's chunks/s divided by the reference's in that round.

Variants are ``backend:max_seq_length:batch_size[:flags]`` with flags from ``fused`` (ONNX Runtime's
transformer optimizer: fused attention / LayerNorm / GELU) and ``nospin`` (intra-op threads sleep
instead of spinning between kernels). Recall of a variant that changes vectors is measured by
``bench_retrieval.py`` (``--fast-max-seq-length``), not here.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_index_speed.py --chunks 256 --rounds 3 \\
        onnx-int8:128:32:fused,nospin onnx-int8:96:32:fused,nospin
    # a distilled student (manage.py distill_encoder) against the same reference:
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_index_speed.py --encoder var/embeddings/minilm-l3 \\
        onnx-int8:96:32:fused,nospin
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from sandboxes.semantic.config import SemanticSearchConfig, default_encoder_path
from sandboxes.semantic.encoder import TorchTextEncoder, encoder_fingerprint, load_encoder, text_encoder_load
from training.embeddings.evaluation import held_out_files, retrieval_set_build

REFERENCE = "torch:256:32"


def _variant(spec: str, *, path: str, cache: Path, threads: int):
    """(encoder, batch size) for ``backend:max_seq_length:batch_size[:flag,flag]``."""
    backend, length, batch, *rest = spec.split(":")
    flags = set(rest[0].split(",")) if rest else set()
    model = load_encoder(path=path, max_seq_length=int(length))
    if backend == "torch":
        return TorchTextEncoder(model), int(batch)
    if backend == "torch-bf16":
        from sandboxes.semantic.bf16_encoder import TorchBf16TextEncoder

        return TorchBf16TextEncoder(model=model, max_seq_length=int(length)), int(batch)
    if backend == "openvino-int8":  # no flags: the index's own loader (torch's thread count, set in main)
        config = SemanticSearchConfig(encoder_path=path, encoder_backend=backend, max_seq_length=int(length),
                                      encoder_cache_dir=cache, vector_store="memory")
        return text_encoder_load(config=config), int(batch)
    from sandboxes.semantic.fast_encoder import OnnxTextEncoder, onnx_model_path

    onnx_path = onnx_model_path(model=model, cache_dir=cache / encoder_fingerprint(path), backend=backend,
                                fused="fused" in flags)
    encoder = OnnxTextEncoder(model=model, onnx_path=onnx_path, max_seq_length=int(length), threads=threads,
                              spinning="nospin" not in flags)
    return encoder, int(batch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="backend:max_seq_length:batch_size[:fused,nospin]")
    parser.add_argument("--encoder", default=None,
                        help="the variants' model directory, e.g. a distilled student (default: the bundled MiniLM); "
                             "the reference is always the bundled MiniLM")
    parser.add_argument("--chunks", type=int, default=256, help="chunks timed per round (fixed sample)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--encoder-cache", default="var/sandboxes/semantic-encoders")
    args = parser.parse_args()
    import torch

    threads = int(os.environ.get("OMP_NUM_THREADS", str(os.cpu_count())))
    torch.set_num_threads(threads)
    path = args.encoder or default_encoder_path()
    retrieval_set = retrieval_set_build(files=held_out_files(), max_queries=10, seed=0)
    rows = np.random.default_rng(0).permutation(len(retrieval_set.chunks))[:args.chunks]
    texts = [retrieval_set.chunks[row].embedding_text() for row in sorted(rows)]
    specs = [REFERENCE, *[spec for spec in args.variants if spec != REFERENCE]]
    encoders = {spec: _variant(spec, path=default_encoder_path() if spec == REFERENCE else path,
                               cache=Path(args.encoder_cache), threads=threads) for spec in specs}
    print(f"{len(texts)} chunks, {threads} threads, load {os.getloadavg()[0]:.2f}", flush=True)
    for encoder, batch in encoders.values():
        encoder.encode(texts[:batch], batch_size=batch)  # warm-up
    rates: dict[str, list[float]] = {spec: [] for spec in specs}
    for round_number in range(args.rounds):
        shift = round_number % len(specs)
        for spec in specs[shift:] + specs[:shift]:
            encoder, batch = encoders[spec]
            started = time.perf_counter()
            encoder.encode(texts, batch_size=batch)
            rates[spec].append(len(texts) / (time.perf_counter() - started))
        print(f"round {round_number + 1} (load {os.getloadavg()[0]:.2f}): "
              + ", ".join(f"{spec} {rates[spec][-1]:.1f}" for spec in specs), flush=True)
    print("\n| variant | chunks/s (median) | x reference, same rounds (median; min-max) |\n|---|---|---|")
    for spec in specs:
        ratios = [rate / ref for rate, ref in zip(rates[spec], rates[REFERENCE], strict=True)]
        print(f"| {spec} | {np.median(rates[spec]):.1f} | {np.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
