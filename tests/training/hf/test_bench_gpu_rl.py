"""benchmarks/bench_gpu_rl.py: its CPU smoke mode runs one real update; without CUDA it refuses clearly."""

from __future__ import annotations

import re

import pytest
import torch

from benchmarks import bench_gpu_rl

pytest.importorskip("transformers")


def test_smoke_mode_runs_one_update_and_prints_both_rates(capsys):
    assert bench_gpu_rl.main(["--device", "cpu", "--tiny"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"generation: 32 tokens in [\d.]+ s = [\d.]+ tokens/s", out), out
    assert re.search(r"training: +\d+ tokens in [\d.]+ s = [\d.]+ tokens/s", out), out
    replay = float(re.search(r"max \|learner - sampler logprob\| = (\S+);", out).group(1))
    assert replay < 1e-4  # the learner's forward with routing replay reproduces the sampler's logprobs


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so(capsys):
    assert bench_gpu_rl.main([]) == bench_gpu_rl.NO_CUDA_EXIT
    assert "no CUDA device here" in capsys.readouterr().err
