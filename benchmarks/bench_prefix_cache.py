"""Agent-shaped generation with and without the engine's prefix cache (training.engine).

The workload is what the agent loop sends during RL and in the product: conversations that share a
system prompt with the tool schemas (~1.5k tokens of the tiny model's tokenizer), each turn repeating
the whole conversation so far plus a tool result, several conversations in flight at once. Both
engines get the same requests in the same order (the next turn of a conversation is queued when its
previous turn finishes, as the agent loop does); the baseline prefills every prompt in full.

    .venv/bin/python benchmarks/bench_prefix_cache.py                      # random tiny model
    .venv/bin/python benchmarks/bench_prefix_cache.py --checkpoint models/demo

Prints seconds per workload for each engine, the share of prompt tokens served from the cache, and the
ratio baseline / cached (higher is better). Generation runs on one thread, as in the inference actor.

It also times one long prefill (system prompt + task, as on a conversation's first turn) through the
fused inference forward and through MoETransformer.forward, which the engine uses for inputs longer
than training.engine.FUSED_MAX_TOKENS.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.engine import EngineConfig, GenerationEngine, SamplingParams
from training.model import ModelConfig, MoETransformer
from training.model.fused_forward import FusedForward
from training.model.kv_cache import KVCache


def conversations_run(engine: GenerationEngine, args: argparse.Namespace) -> float:
    """Run every conversation to its last turn; returns the wall time."""
    generator = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size

    def random_tokens(count: int) -> list[int]:
        return torch.randint(8, vocab, (count,), generator=generator).tolist()

    system = random_tokens(args.system_tokens)
    prompts = {index: system + random_tokens(args.task_tokens) for index in range(args.conversations)}
    turns = dict.fromkeys(prompts, 0)
    params = {
        index: SamplingParams(max_tokens=args.completion_tokens, temperature=0.8, seed=index) for index in prompts
    }
    requests = {engine.add_request(prompt, params[index]): index for index, prompt in prompts.items()}
    started = time.perf_counter()
    while engine.has_unfinished():
        for event in engine.step():
            if event.result is None:
                continue
            index = requests.pop(event.request_id)
            turns[index] += 1
            if turns[index] < args.turns:
                # the tool's answer follows the assistant turn, and the conversation goes on
                prompts[index] = prompts[index] + event.result.token_ids + random_tokens(args.tool_tokens)
                requests[engine.add_request(prompts[index], params[index])] = index
    return time.perf_counter() - started


def prefill_seconds(model: MoETransformer, tokens: int, *, fused: bool, repeats: int = 3) -> float:
    """Best-of-repeats time of one prefill of `tokens` tokens into an empty cache slot."""
    cache = KVCache(model.config, max_batch_size=1, max_seq_len=model.config.max_seq_len)
    input_ids = torch.randint(8, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    fused_forward = FusedForward(model)
    best = float("inf")
    for _ in range(repeats):
        cache.release(0)
        started = time.perf_counter()
        with torch.inference_mode():
            if fused:
                fused_forward(input_ids, cache, slots=[0], starts=[0], return_routing=True)
            else:
                model(input_ids, kv_cache=cache, cache_slots=torch.tensor([0]), return_routing=True,
                      compute_router_losses=False)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None, help="model to run (default: a random tiny model)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="engine slots (concurrent sequences)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--task-tokens", type=int, default=150)
    parser.add_argument("--tool-tokens", type=int, default=250)
    parser.add_argument("--completion-tokens", type=int, default=80)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.checkpoint:
        from training.checkpoint import load_checkpoint

        model = load_checkpoint(args.checkpoint)[0]
    else:
        torch.manual_seed(0)
        model = MoETransformer(ModelConfig.named("tiny", max_seq_len=4096))
    model.eval()
    longest = args.system_tokens + args.task_tokens + args.turns * (args.tool_tokens + args.completion_tokens)
    if longest > model.config.max_seq_len:
        raise SystemExit(f"conversations reach {longest} tokens, past the model's {model.config.max_seq_len}")
    seconds = {}
    for name, size in (("baseline (no prefix cache)", 0), ("prefix cache", 4 * args.conversations)):
        engine = GenerationEngine(model, config=EngineConfig(max_batch_size=args.batch, prefix_cache_size=size))
        conversations_run(engine, args)  # warm-up: allocations, fused weights
        engine = GenerationEngine(model, config=EngineConfig(max_batch_size=args.batch, prefix_cache_size=size))
        seconds[name] = conversations_run(engine, args)
        stats = engine.prefix_stats
        share = stats["reused_tokens"] / stats["prompt_tokens"] if stats["prompt_tokens"] else 0.0
        print(f"{name:28s} {seconds[name]:6.2f} s   prompt tokens from the cache: {share:.0%}")
    ratio = seconds["baseline (no prefix cache)"] / seconds["prefix cache"]
    print(
        f"{args.conversations} conversations x {args.turns} turns, {args.batch} slots: "
        f"speed-up {ratio:.2f}x (baseline / prefix cache)"
    )
    first_turn = args.system_tokens + args.task_tokens
    fused = prefill_seconds(model, first_turn, fused=True)
    unfused = prefill_seconds(model, first_turn, fused=False)
    print(
        f"prefill of {first_turn} tokens: fused forward {fused * 1000:.0f} ms, MoETransformer.forward "
        f"{unfused * 1000:.0f} ms, ratio {fused / unfused:.2f}x (fused / forward; the engine takes the forward "
        "for prefills)"
    )


if __name__ == "__main__":
    main()
