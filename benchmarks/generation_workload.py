"""The generation workloads the engine benchmarks share (imported by bench_*.py, not a benchmark itself)."""

from __future__ import annotations

import torch

from training.engine import SamplingParams
from training.model import ModelConfig, MoETransformer


def decode_workload(
    *, size: str, workload: str, batch: int, temperature: float = 0.0, max_seq_len: int = 1024
) -> tuple[MoETransformer, list[list[int]], list[SamplingParams]]:
    """A seeded random-weight model in eval mode, and the prompts and sampling params of one workload.

    "uniform": `batch` requests of 64 prompt and 64 new tokens; "mixed": 4 x `batch` requests of 8-120
    new tokens, so continuous batching has sequences to swap in.
    """
    config = ModelConfig.named(size, max_seq_len=max_seq_len)
    torch.manual_seed(0)
    model = MoETransformer(config).eval()
    count = batch if workload == "uniform" else 4 * batch
    prompts = torch.randint(8, config.vocab_size, (count, 64)).tolist()
    lengths = [64] * count if workload == "uniform" else torch.randint(8, 121, (count,)).tolist()
    params = [SamplingParams(max_tokens=n, temperature=temperature, seed=i) for i, n in enumerate(lengths)]
    return model, prompts, params
