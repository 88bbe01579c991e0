"""Data and expert parallelism on the CPU with 2 gloo processes, compared against one process.

Tolerances: expert-parallel layer outputs/gradients within 1e-5 absolute (the same rows go through
the same expert matmuls, only grouped in different batches); training losses of 2-rank runs within
1e-5 of the single process that accumulates the same micro-batches (gradients are summed in a
different order).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.model.config import ModelConfig
from training.model.moe import MoEFeedForward
from training.train.distributed import DistributedContext, ExpertParallelFeedForward

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# DeepSeek-V3's router (an imported deepseek_v3 model): sigmoid scores, a choice-only bias, 2 groups of 2
# experts of which a token may use 1, scaled gates, and a shared expert replicated on every rank.
DEEPSEEK_ROUTER = {"router_score": "sigmoid", "router_score_bias": True, "n_expert_groups": 2, "top_k_groups": 1,
                   "routed_scaling_factor": 2.5, "n_shared_experts": 1}


def _reference_layer(router: str = "softmax") -> tuple[MoEFeedForward, torch.Tensor]:
    torch.manual_seed(3)
    extra = DEEPSEEK_ROUTER if router == "deepseek" else {}
    config = ModelConfig.named(
        "tiny", n_experts=4, top_k=2, d_model=32, d_ff_expert=48, n_heads=4, n_kv_heads=2, **extra
    )
    layer = MoEFeedForward(config)
    layer.reset_parameters(std=0.2, output_std=0.2)
    if layer.score_bias is not None:
        layer.score_bias.normal_(0.0, 0.1)
    tokens = torch.randn(2 * 13, config.d_model)
    return layer, tokens


def _expert_parallel_worker(rank: int, port: int, out_dir: str, router: str = "softmax") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        layer, tokens = _reference_layer(router)
        sharded = ExpertParallelFeedForward(layer, context=DistributedContext(rank=rank, world_size=WORLD))
        local = tokens.chunk(WORLD)[rank].clone().requires_grad_()
        out, routed = sharded(local)
        (out.square().sum() + routed.load_balancing_loss).backward()
        torch.save(
            {
                "out": out.detach(),
                "input_grad": local.grad,
                "w_gate_grad": sharded.w_gate.grad,
                "w_down_grad": sharded.w_down.grad,
                "router_grad": sharded.router.weight.grad,
                "shared_grad": None if sharded.shared_experts is None else sharded.shared_experts.w_up.weight.grad,
                "load_balancing": routed.load_balancing_loss.detach(),
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("router", ["softmax", "deepseek"])
def test_expert_parallel_layer_matches_single_process(tmp_path, router):
    mp.spawn(_expert_parallel_worker, args=(_free_port(), str(tmp_path), router), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]

    # Single process: the full layer sees each rank's tokens as its own micro-batch.
    layer, tokens = _reference_layer(router)
    outputs, input_grads = [], []
    for chunk in tokens.chunk(WORLD):
        local = chunk.clone().requires_grad_()
        out, routed = layer(local)
        (out.square().sum() + routed.load_balancing_loss).backward()
        outputs.append(out.detach())
        input_grads.append(local.grad)
        assert routed.load_balancing_loss.item() == pytest.approx(
            ranks[len(outputs) - 1]["load_balancing"].item(), abs=1e-6
        )
    # Gradients sum token and expert contributions in a different order on two ranks than in one
    # process, and their entries reach ~30: fp32 rounding then differs by a few ulps (rel. ~1e-6,
    # abs. up to ~2e-5), hence rtol=1e-5 on every gradient. A wrong routing or a lost all-to-all
    # chunk is off by whole units, far outside that.
    for rank in range(WORLD):
        torch.testing.assert_close(ranks[rank]["out"], outputs[rank], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ranks[rank]["input_grad"], input_grads[rank], atol=1e-5, rtol=1e-5)
    # Each rank owns half the experts and got the gradient from both ranks' tokens.
    half = layer.config.n_experts // WORLD
    # DeepSeek's gates are scaled 2.5x and a shared expert adds to every output, so the squared loss's expert
    # gradients are larger and a few entries that cancel differ by ~5e-5; a wrong routing is off by units.
    expert_atol = 1e-4 if router == "deepseek" else 1e-5
    torch.testing.assert_close(torch.cat([r["w_gate_grad"] for r in ranks]), layer.w_gate.grad, atol=expert_atol, rtol=1e-5)
    torch.testing.assert_close(torch.cat([r["w_down_grad"] for r in ranks]), layer.w_down.grad, atol=expert_atol, rtol=1e-5)
    assert ranks[0]["w_gate_grad"].shape[0] == half
    # The replicated router's gradients sum (over ranks, as DDP will) to the single-process gradient.
    torch.testing.assert_close(ranks[0]["router_grad"] + ranks[1]["router_grad"], layer.router.weight.grad, atol=1e-5, rtol=1e-5)
    if layer.shared_experts is not None:
        torch.testing.assert_close(ranks[0]["shared_grad"] + ranks[1]["shared_grad"],
                                   layer.shared_experts.w_up.weight.grad, atol=1e-5, rtol=1e-5)


def test_expert_parallel_rejects_indivisible_expert_count():
    layer, _ = _reference_layer()
    with pytest.raises(ValueError, match="divides n_experts"):
        ExpertParallelFeedForward(layer, context=DistributedContext(rank=0, world_size=3))


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from training.tokenizer import default_tokenizer

    return default_tokenizer(2048).save(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")


def _pretrain(run_dir: Path, tokenizer_file: Path, *, ranks: int, extra: tuple[str, ...] = ()) -> list[dict]:
    args = [
        "manage.py", "pretrain", "--run-dir", str(run_dir), "--tokenizer", str(tokenizer_file), "--steps", "4",
        "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", "64", "--corpus-max-bytes", "100000",
        "--checkpoint-every", "0", "--warmup-steps", "1", "--lr", "3e-3", *extra,
    ]
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
                     f"--master-port={_free_port()}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(launcher + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_rank_data_and_expert_parallel_training_match_one_process(tmp_path, tokenizer_file):
    single = _pretrain(tmp_path / "single", tokenizer_file, ranks=1)
    data_parallel = _pretrain(tmp_path / "dp", tokenizer_file, ranks=2)
    expert_parallel = _pretrain(tmp_path / "ep", tokenizer_file, ranks=2, extra=("--expert-parallel",))
    assert [m["step"] for m in single] == [1, 2, 3, 4]
    assert single[-1]["loss"] < single[0]["loss"]
    for reference, dp, ep in zip(single, data_parallel, expert_parallel, strict=True):
        assert dp["tokens"] == ep["tokens"] == reference["tokens"]
        assert dp["loss"] == pytest.approx(reference["loss"], abs=1e-5)
        assert ep["loss"] == pytest.approx(reference["loss"], abs=1e-5)
        assert ep["load_balancing_loss"] == pytest.approx(reference["load_balancing_loss"], abs=1e-5)
        assert ep["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
    # The expert-parallel run reassembles full experts into an ordinary checkpoint.
    from training.checkpoint import load_checkpoint

    model, _, _ = load_checkpoint(tmp_path / "ep" / "checkpoints" / "step-00000004")
    assert model.layers[0].feed_forward.w_gate.shape[0] == model.config.n_experts

    # Its optimizer state was sharded per rank, so resuming it is refused with the way out.
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match="--init-checkpoint"):
        call_command("pretrain", "--run-dir", str(tmp_path / "ep"), "--tokenizer", str(tokenizer_file),
                     "--steps", "5", "--batch-size", "4", "--seq-len", "64", "--corpus-max-bytes", "100000")
