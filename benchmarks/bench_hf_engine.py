"""Imported Hugging Face MoE families: Flowstate's GenerationEngine vs transformers `generate` (CPU).

For each MoE family (Qwen3-MoE, OLMoE, Mixtral) a random model is built with transformers, saved, loaded
into Flowstate's MoETransformer (training.hf.loading) and both generate the same mixed workload: 16
requests of varied prompt and output lengths, batch 8. transformers runs static left-padded batches of 8
that wait for their longest member (min_new_tokens = max_new_tokens, no early stop); the engine refills
finished slots at once (continuous batching). Throughput counts only the requested tokens.
--unfused also times the engine with EngineConfig(fused_forward=False) (MoETransformer.forward at every
step: what Qwen3-MoE and OLMoE decoded through before the fused path computed qk-norm and clipping).

    .venv/bin/python benchmarks/bench_hf_engine.py [--families qwen3_moe,olmoe,mixtral] [--threads 2] [--unfused]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.engine import EngineConfig, GenerationEngine, SamplingParams
from training.hf.loading import load_hf_model

SIZE = {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 4, "max_position_embeddings": 1024, "num_experts_per_tok": 2}
CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SIZE, moe_intermediate_size=256, num_experts=8,
                                                     head_dim=32, norm_topk_prob=True),
    "olmoe": lambda: transformers.OlmoeConfig(**SIZE, intermediate_size=256, num_experts=8),
    "mixtral": lambda: transformers.MixtralConfig(**SIZE, intermediate_size=256, num_local_experts=8,
                                                  sliding_window=None),
}


def workload(vocab: int, requests: int = 16, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt, output length) pairs: prompts of 8-96 tokens, outputs of 16-96 tokens."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(requests):
        prompt_len = int(torch.randint(8, 97, (1,), generator=generator))
        out_len = int(torch.randint(16, 97, (1,), generator=generator))
        pairs.append((torch.randint(1, vocab, (prompt_len,), generator=generator).tolist(), out_len))
    return pairs


def run_hf(model, pairs, batch: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for first in range(0, len(pairs), batch):
            group = pairs[first:first + batch]
            longest = max(len(p) for p, _ in group)
            ids = torch.zeros(len(group), longest, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (prompt, _) in enumerate(group):
                ids[row, longest - len(prompt):] = torch.tensor(prompt)
                mask[row, longest - len(prompt):] = 1
            new = max(n for _, n in group)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start


def run_engine(model, pairs, batch: int, fused: bool = True) -> float:
    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=batch, max_seq_len=256, fused_forward=fused))
    start = time.perf_counter()
    engine.generate([p for p, _ in pairs], [SamplingParams(max_tokens=n, temperature=0.0) for _, n in pairs])
    return time.perf_counter() - start


def imported_pair(family: str):
    """(transformers' random model of ``family``, the same weights imported into Flowstate's model)."""
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(CONFIGS[family](), dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as directory:
        reference.save_pretrained(directory)
        model, _, _ = load_hf_model(directory, dtype=torch.float32)
    return reference, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(CONFIGS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--unfused", action="store_true", help="also time the engine without the fused path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'family':<10} {'params':>9} {'tokens':>7} {'HF tok/s':>9} {'engine tok/s':>12} {'ratio':>6}"
          + (f" {'unfused tok/s':>13} {'ratio':>6}" if args.unfused else ""))
    for family in args.families.split(","):
        reference, model = imported_pair(family)
        pairs = workload(SIZE["vocab_size"])
        tokens = sum(n for _, n in pairs)
        run_engine(model, pairs[:2], args.batch)  # warm-up
        engine_s = run_engine(model, pairs, args.batch)
        hf_s = run_hf(reference, pairs, args.batch)
        unfused = ""
        if args.unfused:
            unfused_s = run_engine(model, pairs, args.batch, fused=False)
            unfused = f" {tokens / unfused_s:>13.1f} {hf_s / unfused_s:>5.2f}x"
        params = sum(p.numel() for p in reference.parameters())
        print(f"{family:<10} {params / 1e6:>8.1f}M {tokens:>7} {tokens / hf_s:>9.1f} {tokens / engine_s:>12.1f} "
              f"{hf_s / engine_s:>5.2f}x{unfused}", flush=True)


if __name__ == "__main__":
    main()
