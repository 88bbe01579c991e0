"""The generation engine's fused inference forward: same logits and routing as MoETransformer.forward."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from training.engine import EngineConfig, GenerationEngine, SamplingParams
from training.model import KVCache, ModelConfig, MoETransformer
from training.model.fused_forward import FusedForward, fused_forward_supports

torch.set_num_threads(1)


def _model(**overrides) -> MoETransformer:
    torch.manual_seed(0)
    # larger init than training uses so random weights give peaked, input-dependent distributions
    config = ModelConfig.named("tiny", **{"max_seq_len": 64, "init_std": 0.2, **overrides})
    return MoETransformer(config).eval()


def _reference_and_fused(model, input_ids, slots, prefill):
    """Logits [B, T - prefill + 1, V] and routing [B, T, L, K] of a prefill then one-token decode steps."""
    batch, length = input_ids.shape
    reference_cache, fused_cache = (KVCache(model.config, max_batch_size=4, max_seq_len=32) for _ in range(2))
    fused = FusedForward(model)
    reference_logits, reference_routing, fused_logits, fused_routing = [], [], [], []
    with torch.inference_mode():
        for start, end in [(0, prefill), *((p, p + 1) for p in range(prefill, length))]:
            piece = input_ids[:, start:end]
            out = model(
                piece,
                kv_cache=reference_cache,
                cache_slots=torch.tensor(slots),
                return_routing=model.config.is_moe,
                compute_router_losses=False,
            )
            reference_logits.append(out.logits[:, -1])
            reference_routing.append(out.routed_experts)
            result = fused(piece, fused_cache, slots=slots, starts=[start] * batch, return_routing=True)
            fused_logits.append(result.logits)
            fused_routing.append(result.routed_experts)
    assert torch.equal(fused_cache.lengths, reference_cache.lengths)
    routing = (
        (torch.cat(reference_routing, 1), torch.cat(fused_routing, 1))
        if model.config.is_moe
        else (None, None)
    )
    return torch.stack(reference_logits, 1), torch.stack(fused_logits, 1), *routing


@pytest.mark.parametrize(
    "overrides",
    [{}, {"n_experts": 8}, {"feed_forward": "dense"}],
    ids=["moe-all-experts", "moe-dispatch", "dense"],  # 8 experts, top-2: the model's own dispatch
)
@pytest.mark.parametrize("slots", [[1, 2, 3], [3, 0, 2]], ids=["consecutive-slots", "scattered-slots"])
def test_fused_forward_equals_the_model_forward(overrides, slots):
    model = _model(**overrides)
    input_ids = torch.randint(0, model.config.vocab_size, (3, 12))
    reference, fused, reference_routing, fused_routing = _reference_and_fused(
        model, input_ids, slots, prefill=7
    )
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)
    if model.config.is_moe:
        assert torch.equal(fused_routing, reference_routing)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_low_precision_fused_forward_is_as_close_to_fp32_as_the_model_forward(precision):
    """Rounding differs between the two paths, so compare each with the same weights run in fp32; a routing
    near-tie may go either way (MXFP8 experts run through the model's own layer)."""
    model = _model(precision=precision, init_std=0.02)
    fp32_model = _model(init_std=0.02)
    fp32_model.load_state_dict(model.state_dict())
    input_ids = torch.randint(0, model.config.vocab_size, (3, 12))
    reference, fused, _, _ = _reference_and_fused(model, input_ids, [3, 0, 2], prefill=7)
    exact, _, _, _ = _reference_and_fused(fp32_model, input_ids, [3, 0, 2], prefill=7)
    reference_error, fused_error = (reference - exact).abs(), (fused - exact).abs()
    assert fused_error.max() <= 1.5 * reference_error.max()
    assert fused_error.mean() <= 1.2 * reference_error.mean()


def test_fused_forward_is_inference_only_and_checks_cache_room():
    model = _model()
    cache = KVCache(model.config, max_batch_size=2, max_seq_len=16)
    out = FusedForward(model)(torch.ones(2, 3, dtype=torch.long), cache, slots=[0, 1], starts=[0, 0])
    assert not out.logits.requires_grad and out.logits.shape == (2, model.config.vocab_size)
    assert cache.lengths.tolist() == [3, 3]
    with pytest.raises(ValueError, match="past the KV cache's max_seq_len=16"):
        FusedForward(model)(torch.ones(2, 4, dtype=torch.long), cache, slots=[0, 1], starts=[3, 13])


def test_weight_updates_reach_the_fused_weights():
    """RL pushes weights with load_state_dict (copy or assign) and trainers update in place."""
    model, other = _model(), _model(init_std=0.3)
    fused = FusedForward(model)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 5))

    def logits_agree() -> bool:
        cache = KVCache(model.config, max_batch_size=2, max_seq_len=8)
        fused_logits = fused(input_ids, cache, slots=[0, 1], starts=[0, 0]).logits
        with torch.no_grad():
            expected = model(input_ids).logits[:, -1]
        return torch.allclose(fused_logits, expected, rtol=1e-4, atol=1e-3)

    assert logits_agree()
    built = fused.weights()
    assert fused.weights() is built  # unchanged parameters: no rebuild

    model.load_state_dict(other.state_dict())
    assert logits_agree()

    with torch.no_grad():
        model.layers[1].feed_forward.w_up.mul_(1.5)  # what an optimizer step does
    assert logits_agree()

    model.load_state_dict(_model(init_std=0.1).state_dict(), assign=True)
    assert logits_agree()


@pytest.mark.parametrize("feed_forward", ["moe", "dense"])
def test_fused_engine_generates_what_the_reference_engine_generates(feed_forward):
    """Continuous batching with ragged prompts: slots are reused out of order and rows sit at different lengths."""
    model = _model(feed_forward=feed_forward)
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(8, 2048, (n,), generator=generator).tolist()
        for n in torch.randint(3, 17, (7,), generator=generator).tolist()
    ]
    params = [
        SamplingParams(max_tokens=4 + 3 * i, temperature=(0.0, 1.0)[i % 2], top_p=0.9, seed=i)
        for i in range(7)
    ]
    reference, fused = (
        GenerationEngine(model, config=EngineConfig(max_batch_size=3, fused_forward=flag)).generate(
            prompts, params
        )
        for flag in (False, True)
    )
    for expected, result in zip(reference, fused, strict=True):
        assert result.token_ids == expected.token_ids
        torch.testing.assert_close(
            torch.tensor(result.logprobs), torch.tensor(expected.logprobs), rtol=1e-5, atol=1e-5
        )
        if feed_forward == "moe":
            assert torch.equal(result.routed_experts, expected.routed_experts)
        else:
            assert result.routed_experts is None and expected.routed_experts is None


def test_a_model_built_in_inference_mode_generates():
    """Such parameters keep no version counter, which the change detection must not trip over."""
    with torch.inference_mode():
        model = _model()
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    params = SamplingParams(max_tokens=5, temperature=0)
    reference, fused = (
        GenerationEngine(model, config=EngineConfig(max_batch_size=2, fused_forward=flag)).generate(
            prompts, params
        )
        for flag in (False, True)
    )
    assert [r.token_ids for r in fused] == [r.token_ids for r in reference]


def test_dropped_fused_forwards_leave_no_hook_behind():
    model = _model()
    for _ in range(3):
        FusedForward(model)
    gc.collect()
    assert not model._load_state_dict_post_hooks


def test_only_models_that_may_compute_every_expert_hold_a_fused_expert_copy():
    """For 8 experts and top-2 the all-experts path never pays, so a copy of every expert would be waste."""
    assert all(layer.ffn_in is not None for layer in FusedForward(_model()).weights().layers)
    assert all(layer.ffn_in is None for layer in FusedForward(_model(n_experts=8)).weights().layers)


@pytest.mark.parametrize(
    "overrides",
    [{"qk_norm": "head"}, {"qk_norm": "full", "clip_qkv": 0.6}, {"qkv_bias": True, "output_bias": True},
     {"qk_norm": "head", "qkv_bias": True, "n_experts": 8}, {"clip_qkv": 0.5, "feed_forward": "dense"}],
    ids=["qwen3-head-qk-norm", "olmoe-full-qk-norm-clip", "biases", "qk-norm-biases-dispatch", "clip-only-dense"],
)
@pytest.mark.parametrize("slots", [[1, 2, 3], [3, 0, 2]], ids=["consecutive-slots", "scattered-slots"])
def test_fused_forward_computes_the_imported_families_options(overrides, slots):
    """qk-norm, clipping and biases (Qwen3, OLMoE, Qwen2) inside the fused path equal the model's forward,
    with the norm weights and biases random (not their identity initialisation) and clipping active."""
    assert fused_forward_supports(ModelConfig.named("tiny", **overrides))
    model = _model(**overrides)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "q_norm" in name or "k_norm" in name:
                parameter.copy_(1.0 + 0.5 * torch.randn_like(parameter) if "norm" in name else torch.randn_like(parameter))
    input_ids = torch.randint(0, model.config.vocab_size, (3, 12))
    reference, fused, reference_routing, fused_routing = _reference_and_fused(model, input_ids, slots, prefill=7)
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)
    if model.config.is_moe:
        assert torch.equal(fused_routing, reference_routing)
    if model.config.clip_qkv is not None:  # the clamp did bite: without it the logits differ
        projected = model.layers[0].attention.wv(model.layers[0].attention_norm(model.embed(input_ids)))
        assert projected.abs().max() > model.config.clip_qkv


def test_unfolded_rotation_equals_the_model_forward(monkeypatch):
    """Models whose folded projection would be large (Mixtral of bench_hf_engine) rotate Q and K after one
    Q/K/V matmul instead."""
    import training.model.fused_forward as fused_forward

    monkeypatch.setattr(fused_forward, "ROTATION_FOLD_MAX_ELEMENTS", 0)
    model = _model(n_experts=8)
    assert not fused_forward._rotation_folds(model.config)
    input_ids = torch.randint(0, model.config.vocab_size, (3, 12))
    reference, fused, reference_routing, fused_routing = _reference_and_fused(model, input_ids, [3, 0, 2], prefill=7)
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused_routing, reference_routing)
