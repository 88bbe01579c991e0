"""Policy model: config checks, MoE routing and losses, routing replay, KV cache, HF Llama parity."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from training.model import KVCache, ModelConfig, ModelConfigError, MoETransformer
from training.model.moe import MoEFeedForward

torch.set_num_threads(1)


def _tiny_model(seed: int = 0, **overrides) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(ModelConfig.named("tiny", **overrides)).eval()


def test_named_sizes_have_the_promised_parameter_counts():
    tiny, small = ModelConfig.named("tiny"), ModelConfig.named("small")
    tiny_params = sum(p.numel() for p in MoETransformer(tiny).parameters())
    assert tiny_params == tiny.parameter_counts()["total"] < 2_000_000
    assert 10_000_000 <= small.parameter_counts()["total"] <= 30_000_000
    for name in ("base", "large"):
        assert ModelConfig.named(name).parameter_counts()["total"] > small.parameter_counts()["total"]


def test_dense_variant_matches_active_parameters():
    for name in ("tiny", "small"):
        moe, dense = ModelConfig.named(name), ModelConfig.named(f"{name}-dense")
        assert dense.feed_forward == "dense" and dense.d_ff_dense == moe.top_k * moe.d_ff_expert
        router = moe.n_layers * moe.d_model * moe.n_experts
        assert moe.parameter_counts()["active"] - router == dense.parameter_counts()["total"]


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"n_heads": 3}, "divisible by n_heads"),
        ({"n_kv_heads": 3}, "must divide n_heads"),
        ({"top_k": 5}, "top_k=5 must be between 1 and n_experts=4"),
        ({"precision": "fp16"}, "precision='fp16' is unknown"),
        ({"precision": "mxfp8", "d_ff_expert": 100}, "round it up to 128"),
        ({"feed_forward": "sparse"}, "feed_forward='sparse' is unknown"),
        ({"d_model": 0}, "d_model must be positive"),
    ],
)
def test_bad_configs_explain_the_fix(overrides, fragment):
    with pytest.raises(ModelConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.named("tiny", **overrides)


def test_unknown_name_and_unknown_fields_are_rejected():
    with pytest.raises(ModelConfigError, match="Unknown model size 'huge'"):
        ModelConfig.named("huge")
    with pytest.raises(ModelConfigError, match="Unknown ModelConfig fields"):
        ModelConfig.from_dict({**ModelConfig.named("tiny").to_dict(), "n_expert": 3})
    assert ModelConfig.from_dict(ModelConfig.named("small").to_dict()) == ModelConfig.named("small")


def test_forward_returns_logits_losses_and_routing():
    model = _tiny_model()
    config = model.config
    input_ids = torch.randint(0, config.vocab_size, (3, 12))
    out = model(input_ids, return_routing=True)
    assert out.logits.shape == (3, 12, config.vocab_size) and out.logits.dtype == torch.float32
    assert out.routed_experts.shape == (3, 12, config.n_layers, config.top_k)
    assert out.routed_experts.min() >= 0 and out.routed_experts.max() < config.n_experts
    # top-k picks distinct experts per token
    per_token = out.routed_experts.reshape(-1, config.top_k)
    assert (per_token[:, 0] != per_token[:, 1]).all()
    assert out.load_balancing_loss.item() >= 1.0 - 1e-5  # minimum is 1, reached at perfect balance
    assert out.router_z_loss.item() > 0
    assert model(input_ids).routed_experts is None


def test_router_losses_for_a_uniform_router():
    config = ModelConfig.named("tiny")
    layer = MoEFeedForward(config)
    layer.reset_parameters(std=0.02, output_std=0.02)
    with torch.no_grad():
        layer.router.weight.zero_()
    _, router = layer(torch.randn(10, config.d_model))
    assert router.load_balancing_loss.item() == pytest.approx(1.0, abs=1e-6)
    assert router.router_z_loss.item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2, rel=1e-5)


def test_dropless_dispatch_equals_per_token_computation():
    config = ModelConfig.named("tiny")
    torch.manual_seed(1)
    layer = MoEFeedForward(config)
    layer.reset_parameters(std=0.05, output_std=0.05)
    x = torch.randn(9, config.d_model)
    out, router = layer(x)
    probs = layer.router(x).softmax(-1)
    for token in range(x.shape[0]):
        experts = router.expert_indices[token]
        weights = probs[token, experts] / probs[token, experts].sum()
        expected = sum(
            w
            * (torch.nn.functional.silu(x[token] @ layer.w_gate[e]) * (x[token] @ layer.w_up[e]))
            @ layer.w_down[e]
            for w, e in zip(weights, experts.tolist(), strict=True)
        )
        torch.testing.assert_close(out[token], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_generation_all_experts_path_equals_dispatch(precision):
    """Small generation batches compute every expert densely; the result must equal dispatch."""
    from training.model import moe

    config = ModelConfig.named("tiny", precision=precision)
    torch.manual_seed(2)
    layer = MoEFeedForward(config)
    layer.reset_parameters(std=0.05, output_std=0.05)
    x = torch.randn(8, config.d_model)
    assert x.shape[0] * config.n_experts <= moe.DENSE_DECODE_MAX_ROWS
    assert config.n_experts <= moe.DENSE_DECODE_MAX_FLOPS_FACTOR * config.top_k
    with torch.inference_mode():
        dispatched, routed = layer(x)  # router losses requested: always the dispatch path
        dense, dense_routed = layer(x, compute_losses=False)
        replayed, _ = layer(x, routing_override=routed.expert_indices.flip(-1), compute_losses=False)
    assert torch.equal(routed.expert_indices, dense_routed.expert_indices)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if precision == "fp32" else {"rtol": 2e-2, "atol": 2e-3}
    torch.testing.assert_close(dense, dispatched, **tolerance)
    # the top-k order does not matter, only which experts
    torch.testing.assert_close(replayed, dispatched, **tolerance)


def test_routing_replay_reproduces_logits_and_changes_with_other_experts():
    model = _tiny_model()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 10))
    recorded = model(input_ids, return_routing=True)
    replayed = model(input_ids, routing_override=recorded.routed_experts, return_routing=True)
    torch.testing.assert_close(replayed.logits, recorded.logits, rtol=0, atol=0)
    assert torch.equal(replayed.routed_experts, recorded.routed_experts)
    per_layer = [recorded.routed_experts[:, :, i] for i in range(model.config.n_layers)]
    torch.testing.assert_close(model(input_ids, routing_override=per_layer).logits, recorded.logits)
    shifted = (recorded.routed_experts + 1) % model.config.n_experts
    assert not torch.allclose(model(input_ids, routing_override=shifted).logits, recorded.logits)


def test_routing_override_keeps_router_gradients_and_validates_shape():
    model = _tiny_model().train()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 6))
    routing = model(input_ids, return_routing=True).routed_experts
    model(input_ids, routing_override=routing).logits.logsumexp(-1).mean().backward()
    assert model.layers[0].feed_forward.router.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"expected \(2, 6, 2, 2\)"):
        model(input_ids, routing_override=routing[:, :5])
    with pytest.raises(ValueError, match="outside"):
        model(input_ids, routing_override=routing + 10)
    with pytest.raises(ValueError, match="dense model"):
        _tiny_model(feed_forward="dense")(input_ids, routing_override=routing)


def test_kv_cache_decoding_equals_full_forward_in_any_slot_order():
    model = _tiny_model()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 14))
    full = model(input_ids, return_routing=True)
    cache = KVCache(model.config, max_batch_size=4, max_seq_len=32)
    slots = torch.tensor([3, 1])
    with torch.no_grad():
        pieces = [model(input_ids[:, :9], kv_cache=cache, cache_slots=slots, return_routing=True)]
        for position in range(9, 14):
            pieces.append(
                model(
                    input_ids[:, position : position + 1],
                    kv_cache=cache,
                    cache_slots=slots,
                    return_routing=True,
                )
            )
    torch.testing.assert_close(torch.cat([p.logits for p in pieces], 1), full.logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(torch.cat([p.routed_experts for p in pieces], 1), full.routed_experts)
    assert cache.lengths.tolist() == [0, 14, 0, 14]
    with pytest.raises(ValueError, match="past the KV cache's max_seq_len=32"):
        model(torch.zeros(2, 20, dtype=torch.long), kv_cache=cache, cache_slots=slots)


def test_dense_variant_matches_hf_llama_with_the_same_weights():
    transformers = pytest.importorskip("transformers")
    model = _tiny_model(feed_forward="dense", d_ff_dense=512, tie_embeddings=False)
    config = model.config
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.d_model,
            intermediate_size=config.d_ff_dense,
            num_hidden_layers=config.n_layers,
            num_attention_heads=config.n_heads,
            num_key_value_heads=config.n_kv_heads,
            max_position_embeddings=config.max_seq_len,
            rope_theta=config.rope_theta,
            rms_norm_eps=config.norm_eps,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
        )
    ).eval()
    state = {
        "model.embed_tokens.weight": model.embed.weight,
        "model.norm.weight": model.norm.weight,
        "lm_head.weight": model.output.weight,
    }
    for i, block in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        state |= {
            prefix + "input_layernorm.weight": block.attention_norm.weight,
            prefix + "post_attention_layernorm.weight": block.ffn_norm.weight,
            prefix + "self_attn.q_proj.weight": block.attention.wq.weight,
            prefix + "self_attn.k_proj.weight": block.attention.wk.weight,
            prefix + "self_attn.v_proj.weight": block.attention.wv.weight,
            prefix + "self_attn.o_proj.weight": block.attention.wo.weight,
            prefix + "mlp.gate_proj.weight": block.feed_forward.w_gate.weight,
            prefix + "mlp.up_proj.weight": block.feed_forward.w_up.weight,
            prefix + "mlp.down_proj.weight": block.feed_forward.w_down.weight,
        }
    missing, unexpected = llama.load_state_dict(
        {k: v.detach().clone() for k, v in state.items()}, strict=False
    )
    assert not unexpected and all("rotary" in name for name in missing)
    input_ids = torch.randint(0, config.vocab_size, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, llama(input_ids).logits, rtol=1e-4, atol=1e-4)


def test_tiny_model_learns_a_repeated_sequence():
    model = _tiny_model().train()
    sequence = torch.randint(0, model.config.vocab_size, (4, 24))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        out = model(sequence[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            out.logits.reshape(-1, out.logits.shape[-1]), sequence[:, 1:].reshape(-1)
        )
        (loss + 0.01 * out.load_balancing_loss + 0.001 * out.router_z_loss).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_bf16_precision_runs_and_stays_close_to_fp32():
    fp32 = _tiny_model(seed=3)
    bf16 = _tiny_model(seed=3, precision="bf16")
    input_ids = torch.randint(0, fp32.config.vocab_size, (1, 8))
    reference, low = fp32(input_ids).logits, bf16(input_ids).logits
    assert low.dtype == torch.float32
    assert (low - reference).abs().max() < 0.05 * reference.abs().max() + 0.05


def test_mxfp8_experts_train_on_cpu_through_the_kernels_module():
    fp32 = _tiny_model(seed=4)
    mxfp8 = _tiny_model(seed=4, precision="mxfp8").train()
    input_ids = torch.randint(0, fp32.config.vocab_size, (2, 8))
    out = mxfp8(input_ids)
    reference = fp32(input_ids).logits
    assert (out.logits - reference).abs().max() < 0.05 * reference.abs().max() + 0.05
    out.logits.logsumexp(-1).mean().backward()
    assert mxfp8.layers[0].feed_forward.w_down.grad.abs().sum() > 0


def test_logits_positions_select_one_position_per_row():
    model = _tiny_model()
    input_ids = torch.randint(0, model.config.vocab_size, (3, 7))
    full = model(input_ids).logits
    positions = torch.tensor([6, 0, 3])
    picked = model(input_ids, logits_positions=positions).logits
    assert picked.shape == (3, 1, model.config.vocab_size)
    torch.testing.assert_close(picked[:, 0], full[torch.arange(3), positions], rtol=1e-5, atol=1e-5)


def test_logits_mask_computes_logits_only_at_the_masked_positions():
    model = _tiny_model()
    input_ids = torch.randint(0, model.config.vocab_size, (3, 9))
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[0, 2:5] = True
    mask[1, 7] = True  # row 2 has no masked position at all
    full = model(input_ids).logits
    picked = model(input_ids, logits_mask=mask, compute_router_losses=False).logits
    assert picked.shape == (1, 4, model.config.vocab_size)
    torch.testing.assert_close(picked[0], full[mask], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bool tensor shaped like input_ids"):
        model(input_ids, logits_mask=mask[:, :5], compute_router_losses=False)
    with pytest.raises(ValueError, match="not both"):
        model(input_ids, logits_mask=mask, logits_positions=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="compute_router_losses=False"):
        model(input_ids, logits_mask=mask)
