"""Short training run of the tiny policy model: MXFP8 experts versus fp32 (and bf16) after the same steps.

Same initial weights, same batches (byte-level windows of the CPython stdlib sources, vocab 256), same
AdamW settings for every precision; precision="mxfp8" runs the expert GEMMs through
kernels.moe_experts (on the CPU: the reference emulation, bit-identical quantization to the Triton
kernels) under the model's bf16 autocast. Goal: final MXFP8 loss within 0.5 % of fp32.

    .venv/bin/python benchmarks/bench_kernels_training.py --steps 400
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from kernels.numerics import sqnr_db
from training.corpus import CorpusConfig, iter_documents
from training.model import ModelConfig, MoETransformer


def corpus_bytes(max_bytes: int) -> torch.Tensor:
    text = "\n".join(document.text for document in iter_documents(CorpusConfig(max_bytes=max_bytes)))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.long)


def batches(data: torch.Tensor, *, count: int, batch: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq_len - 1, (count, batch), generator=generator)
    return [torch.stack([data[s : s + seq_len + 1] for s in row.tolist()]) for row in starts]


def loss_of(model: MoETransformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(tokens[:, :-1])
    loss = F.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten())
    return loss, loss + 0.01 * out.load_balancing_loss + 0.001 * out.router_z_loss


def train(
    precision: str, train_batches, eval_batches, *, lr: float, seq_len: int, device: torch.device, seed: int = 0
) -> dict[str, float]:
    torch.manual_seed(seed)
    config = ModelConfig.named("tiny", vocab_size=256, max_seq_len=seq_len, precision=precision)
    model = MoETransformer(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # Warmup then cosine decay to 10 %: the end of the run is where the precisions are compared, and a
    # decayed learning rate keeps step-to-step noise there from deciding the comparison.
    steps, warmup = len(train_batches), max(1, len(train_batches) // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (step + 1) / warmup
        if step < warmup
        else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))),
    )
    losses = []
    started = time.perf_counter()
    for tokens in train_batches:
        loss, total = loss_of(model, tokens.to(device))
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    seconds = time.perf_counter() - started
    model.eval()
    with torch.no_grad():
        eval_loss = sum(loss_of(model, tokens.to(device))[0].item() for tokens in eval_batches) / len(eval_batches)
    tail = losses[-10:]
    return {
        "first_loss": losses[0],
        "final_train_loss": sum(tail) / len(tail),
        "eval_loss": eval_loss,
        "seconds_per_step": seconds / len(train_batches),
    }


def gradient_agreement(first_batch: torch.Tensor, seq_len: int, precisions: list[str], device: torch.device) -> None:
    """SQNR (dB) and norm ratio of every parameter's gradient at init, each precision vs fp32."""
    grads = {}
    for precision in ["fp32", *[p for p in precisions if p != "fp32"]]:
        torch.manual_seed(0)
        model = MoETransformer(ModelConfig.named("tiny", vocab_size=256, max_seq_len=seq_len, precision=precision))
        loss_of(model.to(device), first_batch.to(device))[0].backward()
        grads[precision] = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    for precision in grads:
        if precision == "fp32":
            continue
        groups: dict[str, list[tuple[float, float]]] = {}
        for name, reference in grads["fp32"].items():
            group = "experts" if ".w_" in name else "router" if "router" in name else "other"
            ratio = (grads[precision][name].norm() / reference.norm()).item()
            groups.setdefault(group, []).append((sqnr_db(reference, grads[precision][name]), ratio))
        summary = "; ".join(
            f"{group} {min(v[0] for v in values):.1f}-{max(v[0] for v in values):.1f} dB, norm ratio "
            f"{min(v[1] for v in values):.3f}-{max(v[1] for v in values):.3f}"
            for group, values in groups.items()
        )
        print(f"  gradients at init, {precision} vs fp32: {summary}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (shared CPU: keep low)")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "mxfp8"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda: mxfp8 runs the Triton kernels (backend auto); cpu: the reference emulation")
    parser.add_argument(
        "--noise-baseline", action="store_true", help="also train fp32 from another seed (run-to-run spread)"
    )
    args = parser.parse_args()
    if "fp32" not in args.precisions:
        parser.error("fp32 is the baseline and must be among --precisions.")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    data = corpus_bytes(4_000_000)
    train_batches = batches(data, count=args.steps, batch=args.batch, seq_len=args.seq_len, seed=1)
    eval_batches = batches(data, count=32, batch=args.batch, seq_len=args.seq_len, seed=2)
    print(
        f"tiny model, vocab 256 (bytes), {args.steps} AdamW steps lr={args.lr}, batch {args.batch} x "
        f"{args.seq_len} tokens, threads={args.threads}, torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )
    gradient_agreement(train_batches[0], args.seq_len, args.precisions, device)
    results = {
        p: train(p, train_batches, eval_batches, lr=args.lr, seq_len=args.seq_len, device=device)
        for p in args.precisions
    }
    if args.noise_baseline:
        # Same precision, different initial weights: how far two fp32 runs land apart anyway.
        results["fp32 seed 1"] = train(
            "fp32", train_batches, eval_batches, lr=args.lr, seq_len=args.seq_len, device=device, seed=1
        )
    base = results["fp32"]
    for precision, r in results.items():
        train_gap = 100 * (r["final_train_loss"] - base["final_train_loss"]) / base["final_train_loss"]
        eval_gap = 100 * (r["eval_loss"] - base["eval_loss"]) / base["eval_loss"]
        print(
            f"  {precision:11s} loss {r['first_loss']:.3f} -> train(last 10) {r['final_train_loss']:.4f} "
            f"({train_gap:+.2f} % vs fp32), eval {r['eval_loss']:.4f} ({eval_gap:+.2f} % vs fp32), "
            f"{r['seconds_per_step'] * 1000:.0f} ms/step ({r['seconds_per_step'] / base['seconds_per_step']:.2f}x fp32)"
        )
    if "mxfp8" in results:
        for metric in ("final_train_loss", "eval_loss"):
            gap = abs(results["mxfp8"][metric] - base[metric]) / base[metric] * 100
            print(f"mxfp8 vs fp32 {metric} gap {gap:.2f} % (goal <= 0.5 %): {'PASS' if gap <= 0.5 else 'FAIL'}")


if __name__ == "__main__":
    main()
