"""Generation throughput: Flowstate's GenerationEngine vs HF transformers `generate` (KV cache) at equal size.

Baselines, random weights, same prompts, batch size and per-request output lengths (no early stop):
- MoE: MixtralForCausalLM with the same width, depth, heads, vocabulary, experts, top-k and expert width
  (the same parameter count), against the Flowstate MoE model;
- dense: LlamaForCausalLM with intermediate_size = top_k * d_ff_expert, against Flowstate's dense variant
  (the identical architecture; tests/training/test_model.py checks logits match with shared weights).

Workloads: "uniform" is one batch of equal-length requests (pure per-step efficiency); "mixed" is a queue
of requests with varied lengths, where HF runs static batches that wait for their longest member and
the engine refills finished slots at once (continuous batching).

    .venv/bin/python benchmarks/bench_generation.py --size tiny --workload uniform
    .venv/bin/python benchmarks/bench_generation.py --size tiny --workload mixed --temperature 1
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

# Measure the checkout this script is in: the shared virtualenv's editable install maps `training` to
# another one (the other benchmarks do the same).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.engine import EngineConfig, GenerationEngine, SamplingParams
from training.model import ModelConfig, MoETransformer


def hf_llama_like(config: ModelConfig) -> transformers.LlamaForCausalLM:
    dense = config.dense_equivalent()
    hf_config = transformers.LlamaConfig(
        vocab_size=dense.vocab_size,
        hidden_size=dense.d_model,
        intermediate_size=dense.d_ff_dense,
        num_hidden_layers=dense.n_layers,
        num_attention_heads=dense.n_heads,
        num_key_value_heads=dense.n_kv_heads,
        max_position_embeddings=dense.max_seq_len,
        rope_theta=dense.rope_theta,
        rms_norm_eps=dense.norm_eps,
        tie_word_embeddings=dense.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
    )
    return transformers.LlamaForCausalLM(hf_config).eval()


def hf_mixtral_like(config: ModelConfig) -> transformers.MixtralForCausalLM:
    hf_config = transformers.MixtralConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff_expert,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        num_local_experts=config.n_experts,
        num_experts_per_tok=config.top_k,
        max_position_embeddings=config.max_seq_len,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
    )
    return transformers.MixtralForCausalLM(hf_config).eval()


def engine_runner(
    model: MoETransformer, prompts: list[list[int]], lengths: list[int], batch: int, temperature: float
) -> Callable[[], None]:
    """All requests go to the engine at once; it keeps `batch` slots busy (continuous batching)."""
    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=batch, max_seq_len=1024, prefix_cache_size=0))
    params = [
        SamplingParams(max_tokens=n, temperature=temperature, top_p=1.0, seed=i)
        for i, n in enumerate(lengths)
    ]

    def run() -> None:
        results = engine.generate(prompts, params)
        assert [len(r.token_ids) for r in results] == lengths

    return run


def hf_runner(
    model: transformers.PreTrainedModel,
    prompts: list[list[int]],
    lengths: list[int],
    batch: int,
    temperature: float,
) -> Callable[[], None]:
    """Static batches of `batch` requests; each batch runs until its longest request is done."""
    sampling = {"temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature > 0 else {}
    groups = [
        (torch.tensor(prompts[i : i + batch]), lengths[i : i + batch]) for i in range(0, len(prompts), batch)
    ]

    def run() -> None:
        with torch.inference_mode():
            for input_ids, group_lengths in groups:
                longest = max(group_lengths)
                output = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=longest,
                    min_new_tokens=longest,
                    do_sample=temperature > 0,
                    use_cache=True,
                    pad_token_id=0,
                    **sampling,
                )
                assert output.shape == (input_ids.shape[0], input_ids.shape[1] + longest)

    return run


def best_rates(runners: dict[str, Callable[[], None]], tokens: int, repeats: int) -> dict[str, float]:
    """Best-of-N tokens per CPU-second of this thread, contenders interleaved.

    torch runs single-threaded here, so thread CPU time is the work done; unlike wall time it does not
    count the time other processes on this shared machine hold the cores.
    """
    best = dict.fromkeys(runners, float("inf"))
    for run in runners.values():
        run()  # warm-up
    for _ in range(repeats):
        for name, run in runners.items():
            started = time.thread_time()
            run()
            best[name] = min(best[name], time.thread_time() - started)
    return {name: tokens / seconds for name, seconds in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="tiny", help="ModelConfig.named preset")
    parser.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per request (mean for 'mixed')")
    parser.add_argument(
        "--workload",
        choices=("uniform", "mixed"),
        default="uniform",
        help="uniform: one batch, every request --new-tokens long; mixed: --requests requests with "
        "lengths drawn uniformly from [8, 2*new-tokens - 8] (agent turns vary like this)",
    )
    parser.add_argument("--requests", type=int, default=32, help="requests in the mixed workload")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; RL samples at 1.0")
    args = parser.parse_args()
    torch.set_num_threads(1)  # thread CPU time below is then the whole cost
    transformers.logging.set_verbosity_error()

    config = ModelConfig.named(args.size, max_seq_len=1024)
    torch.manual_seed(0)
    count = args.batch if args.workload == "uniform" else args.requests
    prompts = torch.randint(8, config.vocab_size, (count, args.prompt_len)).tolist()
    if args.workload == "uniform":
        lengths = [args.new_tokens] * count
    else:
        lengths = torch.randint(8, 2 * args.new_tokens - 7, (count,)).tolist()
    moe = MoETransformer(config).eval()
    dense = MoETransformer(config.dense_equivalent()).eval()
    llama, mixtral = hf_llama_like(config), hf_mixtral_like(config)
    common = (prompts, lengths, args.batch, args.temperature)
    rates = best_rates(
        {
            "hf_llama": hf_runner(llama, *common),
            "dense": engine_runner(dense, *common),
            "hf_mixtral": hf_runner(mixtral, *common),
            "moe": engine_runner(moe, *common),
        },
        tokens=sum(lengths),
        repeats=args.repeats,
    )
    print(
        f"size={args.size} workload={args.workload} requests={count} batch={args.batch} prompt={args.prompt_len} "
        f"new_tokens={args.new_tokens} temperature={args.temperature} torch={torch.__version__} "
        f"transformers={transformers.__version__} (generated tokens per CPU-second, best of {args.repeats})"
    )
    rows = [
        ("HF MixtralForCausalLM.generate (MoE baseline)", rates["hf_mixtral"], rates["hf_mixtral"]),
        ("Flowstate engine, MoE model", rates["moe"], rates["hf_mixtral"]),
        ("HF LlamaForCausalLM.generate (dense baseline)", rates["hf_llama"], rates["hf_llama"]),
        ("Flowstate engine, dense variant", rates["dense"], rates["hf_llama"]),
    ]
    for label, rate, baseline in rows:
        print(f"{label:48s} {rate:9.1f} tok/s  {rate / baseline:5.2f}x")


if __name__ == "__main__":
    main()
