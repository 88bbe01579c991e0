"""Generation engine: KV-cache decoding, seeded sampling, logprobs, continuous batching, routing capture."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from training.engine import EngineConfig, GenerationEngine, SamplingParams, sample_tokens
from training.model import ModelConfig, MoETransformer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model() -> MoETransformer:
    torch.manual_seed(0)
    # larger init than training uses so random weights give peaked, input-dependent distributions
    return MoETransformer(ModelConfig.named("tiny", max_seq_len=256, init_std=0.2)).eval()


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 17, (count,), generator=generator).tolist()
    return [torch.randint(8, 2048, (n,), generator=generator).tolist() for n in lengths]


def _teacher_forced(model, prompt, tokens, temperature=1.0):
    sequence = torch.tensor([prompt + tokens])
    with torch.no_grad():
        out = model(sequence[:, :-1], return_routing=True)
    logprobs = (out.logits[0] / temperature).log_softmax(-1)
    targets = sequence[0, len(prompt) :]
    return logprobs[len(prompt) - 1 :].gather(1, targets[:, None]).squeeze(1), out


def test_logprobs_and_routing_equal_a_teacher_forced_forward(model):
    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=3))
    prompts = _prompts(3)
    for temperature in (1.0, 0.7):
        results = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=temperature, seed=5))
        for prompt, result in zip(prompts, results, strict=True):
            assert len(result.token_ids) == len(result.logprobs) == 12
            expected, forward = _teacher_forced(model, prompt, result.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(result.logprobs), expected, rtol=1e-4, atol=1e-4)
            assert result.routed_experts.shape == (
                len(prompt) + 11,
                model.config.n_layers,
                model.config.top_k,
            )
            assert torch.equal(result.routed_experts.long(), forward.routed_experts[0])


def test_greedy_kv_cache_decoding_equals_full_recompute(model):
    prompt = _prompts(1, seed=3)[0]
    result = GenerationEngine(model).generate([prompt], SamplingParams(max_tokens=10, temperature=0))[0]
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    assert result.token_ids == tokens[len(prompt) :]


def test_same_seed_same_sample_and_other_seeds_differ(model):
    prompt = _prompts(1, seed=4)[0]
    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=2))

    def sample(seed):
        return engine.generate([prompt], SamplingParams(max_tokens=16, seed=seed, temperature=1.5))[
            0
        ].token_ids

    assert sample(11) == sample(11)
    assert len({tuple(sample(seed)) for seed in range(4)}) > 1


def test_continuous_batching_matches_one_at_a_time_and_lets_requests_join(model):
    prompts = _prompts(7, seed=1)
    params = [
        SamplingParams(max_tokens=4 + 3 * i, temperature=1.0, top_p=0.9, seed=100 + i) for i in range(7)
    ]
    alone = [
        GenerationEngine(model, config=EngineConfig(max_batch_size=1)).generate([p], q)[0]
        for p, q in zip(prompts, params, strict=True)
    ]

    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=3))
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    results, mixed_steps = {}, 0
    while engine.has_unfinished():
        events = engine.step()
        assert engine.num_running <= 3
        emitting = {e.request_id for e in events}
        # a later request decodes in the same step as one of the first three: it joined a running batch
        mixed_steps += bool(emitting & set(ids[:3])) and bool(emitting & set(ids[3:]))
        results |= {e.request_id: e.result for e in events if e.result is not None}
    batched = [results[i] for i in ids]
    for one, many in zip(alone, batched, strict=True):
        assert one.token_ids == many.token_ids
        torch.testing.assert_close(
            torch.tensor(one.logprobs), torch.tensor(many.logprobs), rtol=1e-4, atol=1e-4
        )
        assert torch.equal(one.routed_experts, many.routed_experts)
    assert mixed_steps > 0


def test_new_request_joins_a_running_batch_without_waiting(model):
    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=2))
    long_id = engine.add_request(_prompts(1)[0], SamplingParams(max_tokens=30, temperature=0))
    for _ in range(5):
        engine.step()
    short_id = engine.add_request(_prompts(1, seed=9)[0], SamplingParams(max_tokens=3, temperature=0))
    finished_order = []
    while engine.has_unfinished():
        finished_order += [e.request_id for e in engine.step() if e.result is not None]
    assert finished_order == [short_id, long_id]


def test_stop_tokens_end_generation_and_are_kept(model):
    prompt = _prompts(1, seed=6)[0]
    engine = GenerationEngine(model)
    free_run = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    stop_token = free_run.token_ids[3]
    first_stop = free_run.token_ids.index(stop_token)
    stopped = engine.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop_token,))
    )[0]
    assert stopped.finish_reason == "stop" and free_run.finish_reason == "length"
    assert stopped.token_ids == free_run.token_ids[: first_stop + 1]


def test_tiny_top_p_is_greedy_and_top_p_limits_the_support():
    logits = torch.tensor([[0.0, 3.0, 2.9, -5.0], [1.0, 0.0, 0.0, 0.0]])
    generators = [torch.Generator().manual_seed(s) for s in (0, 1)]
    tokens, logprobs = sample_tokens(
        logits, temperatures=[1.0, 1.0], top_ps=[1e-6, 1e-6], generators=generators
    )
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logprobs, logits.log_softmax(-1)[[0, 1], [1, 0]])
    seen = set()
    for seed in range(200):
        token, _ = sample_tokens(
            logits[:1], temperatures=[1.0], top_ps=[0.6], generators=[torch.Generator().manual_seed(seed)]
        )
        seen.add(int(token))
    assert seen == {1, 2}


def test_sequences_stop_at_the_cache_length_and_cancel_frees_slots(model):
    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=1, max_seq_len=20))
    result = engine.generate([list(range(10, 25))], SamplingParams(max_tokens=50, temperature=0))[0]
    assert result.finish_reason == "length" and len(result.token_ids) == 5
    request = engine.add_request([5, 6, 7], SamplingParams(max_tokens=50))
    engine.step()
    assert engine.cancel(request) and not engine.has_unfinished() and not engine.cancel(request)
    assert engine.generate([[1, 2]], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_bad_requests_are_rejected_clearly(model):
    engine = GenerationEngine(model, config=EngineConfig(max_seq_len=16))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="leaves no room"):
        engine.add_request(list(range(16)))
    with pytest.raises(ValueError, match=r"must be in \[0, 2048\)"):
        engine.add_request([5000])
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="2 prompts but 1"):
        engine.generate([[1], [2]], [SamplingParams()])


def test_sampling_paths_agree_row_by_row():
    """All-greedy, all-sampled and mixed batches take different code paths; a row's token must not care."""
    logits = torch.randn(4, 2048, generator=torch.Generator().manual_seed(0)) * 3

    def sample(rows, temperatures, top_ps):
        return sample_tokens(
            logits[rows],
            temperatures=temperatures,
            top_ps=top_ps,
            generators=[torch.Generator().manual_seed(row) for row in rows],
        )

    sampled_tokens, sampled_logprobs = sample([0, 1, 2], [1.0, 0.7, 1.0], [1.0, 1.0, 0.9])
    mixed_tokens, mixed_logprobs = sample([0, 1, 2, 3], [1.0, 0.7, 1.0, 0.0], [1.0, 1.0, 0.9, 1.0])
    greedy_tokens, greedy_logprobs = sample([3], [0.0], [1.0])
    assert torch.equal(mixed_tokens, torch.cat([sampled_tokens, greedy_tokens]))
    torch.testing.assert_close(mixed_logprobs, torch.cat([sampled_logprobs, greedy_logprobs]))


def test_prefix_cache_reuses_earlier_turns_without_changing_the_results(model):
    """A prompt that extends a finished conversation prefills only its new tokens, and its samples,
    logprobs and recorded experts equal those of an engine that prefills everything."""
    generator = torch.Generator().manual_seed(11)
    shared = torch.randint(8, 2048, (60,), generator=generator).tolist()
    first = shared + torch.randint(8, 2048, (20,), generator=generator).tolist()
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3)
    cached = GenerationEngine(model, config=EngineConfig(max_batch_size=2, prefix_cache_size=4, min_prefix_tokens=16))
    plain = GenerationEngine(model, config=EngineConfig(max_batch_size=2, prefix_cache_size=0))
    turn = cached.generate([first], params)[0]
    assert cached.prefix_stats["hits"] == 0
    # the next turn repeats the conversation; another request shares only the opening
    follow_up = first + turn.token_ids + torch.randint(8, 2048, (15,), generator=generator).tolist()
    other = shared + [9] * 10
    got = cached.generate([follow_up, other], params)
    want = plain.generate([follow_up, other], params)
    assert cached.prefix_stats["hits"] == 2
    assert cached.prefix_stats["reused_tokens"] == len(first) + len(turn.token_ids) - 1 + len(shared)
    for new, reference in zip(got, want, strict=True):
        assert new.token_ids == reference.token_ids
        torch.testing.assert_close(torch.tensor(new.logprobs), torch.tensor(reference.logprobs), rtol=1e-4, atol=1e-4)
        assert torch.equal(new.routed_experts, reference.routed_experts)


def test_prefix_cache_is_dropped_when_the_weights_change():
    torch.manual_seed(1)
    model = MoETransformer(ModelConfig.named("tiny", max_seq_len=256, init_std=0.2)).eval()
    prompt = _prompts(1, seed=5)[0] * 6
    params = SamplingParams(max_tokens=6, temperature=0)
    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=1, prefix_cache_size=4, min_prefix_tokens=8))
    engine.generate([prompt], params)
    engine.generate([prompt], params)
    assert engine.prefix_stats["hits"] == 1
    # an optimizer-style in-place update, then a load_state_dict (the RL weight push)
    with torch.no_grad():
        model.layers[0].attention.wq.weight.mul_(-1.0)
    after_step = engine.generate([prompt], params)[0]
    assert engine.prefix_stats["hits"] == 1
    fresh = GenerationEngine(model, config=EngineConfig(max_batch_size=1, prefix_cache_size=0))
    assert after_step.token_ids == fresh.generate([prompt], params)[0].token_ids
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    state["layers.0.attention.wq.weight"].mul_(-1.0)
    model.load_state_dict(state)
    engine.generate([prompt], params)
    assert engine.prefix_stats["hits"] == 1


def test_prefix_cache_evicts_the_least_recently_used_entry(model):
    prompts = [[index + 10] * 40 for index in range(3)]
    params = SamplingParams(max_tokens=2, temperature=0)
    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=1, prefix_cache_size=2, min_prefix_tokens=8))
    for prompt in prompts:
        engine.generate([prompt], params)
    engine.generate([prompts[0] + [5]], params)  # evicted: no hit
    assert engine.prefix_stats["hits"] == 0
    engine.generate([prompts[2] + [5]], params)
    assert engine.prefix_stats["hits"] == 1


def test_a_deep_cached_prefix_and_a_long_fresh_prompt_admitted_together_both_fit(model):
    """Found by a 60-minute RL run: a row resuming 56 tokens into a cached prefix, padded to a fresh
    40-token prompt's length in the same forward, reached past the cache and failed the whole batch."""
    engine = GenerationEngine(
        model, config=EngineConfig(max_batch_size=2, max_seq_len=64, prefix_cache_size=2, min_prefix_tokens=8)
    )
    plain = GenerationEngine(model, config=EngineConfig(max_batch_size=2, max_seq_len=64, prefix_cache_size=0))
    params = SamplingParams(max_tokens=2, temperature=0)
    first = list(range(100, 155))
    turn = engine.generate([first], params)[0]
    deep = first + turn.token_ids + [7, 8]
    fresh = list(range(300, 340))
    got = engine.generate([deep, fresh], params)
    assert engine.prefix_stats["hits"] == 1
    want = plain.generate([deep, fresh], params)
    assert [result.token_ids for result in got] == [result.token_ids for result in want]


def test_admitted_prompts_of_very_different_lengths_prefill_in_separate_forwards(model):
    """Padding 3-token prompts to a 90-token one wastes most of a forward: _prefill_groups splits by length,
    and the results are those of one request at a time."""
    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=4, max_seq_len=128, prefix_cache_size=0))
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(8, 2048, (n,), generator=generator).tolist() for n in (90, 3, 88, 4)]
    forwards: list[list[int]] = []
    prefill_rows = engine._prefill_rows

    def recorded(rows):
        forwards.append(sorted(len(sequence.prompt) for sequence, _ in rows))
        return prefill_rows(rows)

    engine._prefill_rows = recorded
    params = SamplingParams(max_tokens=6, temperature=0)
    got = engine.generate(prompts, params)
    assert forwards == [[3, 4], [88, 90]]
    single = GenerationEngine(model, config=EngineConfig(max_batch_size=1, max_seq_len=128, prefix_cache_size=0))
    for prompt, result in zip(prompts, got, strict=True):
        assert result.token_ids == single.generate([prompt], params)[0].token_ids
