"""One RL (GRPO) update of an imported Hugging Face MoE on a GPU: generation and training tokens/s.

A random Qwen3-MoE is built with transformers and saved (or --model names a Hugging Face directory), imported
with training.hf.loading onto the device, and one update runs as the RL driver's does: the engine samples
--groups x --group completions (continuous batching, routing recorded), rewards are a toy function of the
tokens (the speed does not depend on them), and the learner runs a forward with routing replay, the GRPO
policy loss, backward and an AdamW step. Printed: generation tokens/s (sampled tokens / wall time) and
training tokens/s (tokens through forward + backward + step / wall time), and the largest difference
between the learner's and the sampler's logprobs (routing replay must reproduce them), so a broken path
cannot post a speed.

    .venv/bin/python benchmarks/bench_gpu_rl.py                  # CUDA; exits with a message without one
    .venv/bin/python benchmarks/bench_gpu_rl.py --device cpu --tiny   # smoke mode (tests run it)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from training.devices import policy_precision  # noqa: E402
from training.engine import EngineConfig, GenerationEngine, SamplingParams  # noqa: E402
from training.hf.loading import load_hf_model  # noqa: E402
from training.train.grpo import GRPOConfig, policy_loss, token_logprobs  # noqa: E402

NO_CUDA_EXIT = 3
"""Exit status when --device cuda is asked for on a machine without CUDA."""

SIZES = {
    # ~1.1B parameters (0.3B active): 12 layers of 32 experts, top-4, bf16 on the GPU
    "gpu": {"vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16,
            "num_key_value_heads": 4, "head_dim": 64, "moe_intermediate_size": 512, "num_experts": 32,
            "num_experts_per_tok": 4},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4,
             "num_experts_per_tok": 2},
}


@dataclass
class Figures:
    """What one update measured."""

    generated_tokens: int
    """Tokens sampled by the engine."""
    generation_s: float
    trained_tokens: int
    """Tokens (prompt + completion) through the learner's forward and backward."""
    training_s: float
    replay_error: float
    """Largest |learner logprob - sampler logprob| over the sampled tokens."""
    loss: float


def save_random_model(directory: Path, size: str) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**SIZES[size], intermediate_size=1024, max_position_embeddings=4096,
                                         norm_topk_prob=True, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate(model, device, args) -> tuple[list, float]:
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (args.prompt_tokens,), generator=generator).tolist() for _ in range(args.groups)]
    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=args.groups * args.group,
                                                         max_seq_len=args.prompt_tokens + args.max_tokens + 1))
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=seed)
              for seed in range(args.groups * args.group)]
    _synchronize(device)
    start = time.perf_counter()
    results = engine.generate([prompt for prompt in prompts for _ in range(args.group)], params)
    _synchronize(device)
    return results, time.perf_counter() - start


def _batch(results, device):
    """Right-padded sequences, routing (padded with expert 0), sampler logprobs, loss mask, group advantages."""
    longest = max(len(r.prompt_token_ids) + len(r.token_ids) for r in results)
    rows = len(results)
    sequences = torch.zeros(rows, longest, dtype=torch.long)
    routing = torch.zeros(rows, longest - 1, *results[0].routed_experts.shape[1:], dtype=torch.long)
    behaviour = torch.zeros(rows, longest - 1)
    mask = torch.zeros(rows, longest - 1)
    for row, result in enumerate(results):
        ids = result.prompt_token_ids + result.token_ids
        start = len(result.prompt_token_ids) - 1
        sequences[row, :len(ids)] = torch.tensor(ids)
        routing[row, :len(ids) - 1] = result.routed_experts.long()
        behaviour[row, start:start + len(result.token_ids)] = torch.tensor(result.logprobs)
        mask[row, start:start + len(result.token_ids)] = 1
    rewards = torch.tensor([float(sum(t % 2 == 0 for t in r.token_ids)) / len(r.token_ids) for r in results])
    return sequences.to(device), routing.to(device), behaviour.to(device), mask.to(device), rewards


def run_update(model, device: torch.device, args) -> Figures:
    results, generation_s = _generate(model, device, args)
    sequences, routing, behaviour, mask, rewards = _batch(results, device)
    grouped = rewards.view(args.groups, args.group)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).flatten().to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    _synchronize(device)
    start = time.perf_counter()
    logits = model(sequences[:, :-1], routing_override=routing, compute_router_losses=False).logits
    logprobs = token_logprobs(logits, sequences[:, 1:])
    out = policy_loss(logprobs=logprobs, behaviour_logprobs=behaviour, advantages=advantages, loss_mask=mask,
                      config=GRPOConfig())
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _synchronize(device)
    training_s = time.perf_counter() - start
    replay_error = float(((logprobs.detach() - behaviour).abs() * mask).max())
    return Figures(generated_tokens=sum(len(r.token_ids) for r in results), generation_s=generation_s,
                   trained_tokens=int(sequences.numel()), training_s=training_s, replay_error=replay_error,
                   loss=float(out.loss.detach()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and workload (smoke test)")
    parser.add_argument("--model", type=Path, help="a Hugging Face MoE directory (default: a random Qwen3-MoE)")
    parser.add_argument("--groups", type=int, help="prompts per update (default 8; tiny 2)")
    parser.add_argument("--group", type=int, help="samples per prompt (default 8; tiny 2)")
    parser.add_argument("--prompt-tokens", type=int, help="tokens per prompt (default 512; tiny 16)")
    parser.add_argument("--max-tokens", type=int, help="tokens sampled per completion (default 256; tiny 8)")
    args = parser.parse_args(argv)
    defaults = (2, 2, 16, 8) if args.tiny else (8, 8, 512, 256)
    for name, default in zip(("groups", "group", "prompt_tokens", "max_tokens"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_rl: no CUDA device here (torch.cuda.is_available() is False); run it on a machine "
              "with a GPU, or smoke-test it with --device cpu --tiny", file=sys.stderr)
        return NO_CUDA_EXIT
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.model
        if directory is None:
            directory = Path(scratch) / "model"
            save_random_model(directory, "tiny" if args.tiny else "gpu")
        model, _, family = load_hf_model(directory, dtype=torch.float32, device=device)
    if device.type == "cuda":  # fp32 master weights, bf16 expert compute: the RL actors' rule on a GPU
        model.config.precision = policy_precision(device, None)
    params = sum(p.numel() for p in model.parameters())
    print(f"model {family.model_type}: {params / 1e6:.1f}M parameters on "
          f"{device} ({model.config.precision}); {args.groups} prompts x {args.group} samples, "
          f"{args.prompt_tokens} prompt + {args.max_tokens} sampled tokens", flush=True)
    figures = run_update(model, device, args)
    print(f"generation: {figures.generated_tokens} tokens in {figures.generation_s:.2f} s = "
          f"{figures.generated_tokens / figures.generation_s:.1f} tokens/s")
    print(f"training:   {figures.trained_tokens} tokens in {figures.training_s:.2f} s = "
          f"{figures.trained_tokens / figures.training_s:.1f} tokens/s (forward + backward + AdamW step)")
    print(f"routing replay: max |learner - sampler logprob| = {figures.replay_error:.2e}; loss {figures.loss:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
