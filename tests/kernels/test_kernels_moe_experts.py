"""kernels.moe_experts.grouped_swiglu: fp32/bf16 paths, the MXFP8 autograd.Function (reference and
Triton backends), and the model's precision="mxfp8" option.

Triton backend vs reference backend, whole layer: >= 60 dB SQNR under the interpreter (same fp32
summation order), >= 45 dB on a GPU. There the tensor cores sum in another order, and the layer
re-quantizes its intermediates (h, grad_h): an fp32 difference in the last bit can move an element
across an E4M3 rounding boundary (one E4M3 step is 6-12 %). Measured on an H100: 51-69 dB per
output; both backends are 23.1-23.7 dB from fp32 there, so 45 dB is still ~20 dB below the MXFP8
noise itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import grouped_gemm_reference as ref
from kernels.moe_experts import BACKEND_ENV_VAR, GroupedSwiGLUConfig, grouped_swiglu
from kernels.mx_format import fake_quantize_mxfp8
from kernels.numerics import sqnr_db
from tests.kernels.helpers import DEVICE, requires_triton

N_EXPERTS, D_MODEL, D_FF = 4, 64, 96
TRITON_VS_REFERENCE_DB = 45.0 if DEVICE.type == "cuda" else 60.0


def make_layer(n_tokens: int, *, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, D_MODEL, generator=generator)
    w_gate = torch.randn(N_EXPERTS, D_MODEL, D_FF, generator=generator) / D_MODEL**0.5
    w_up = torch.randn(N_EXPERTS, D_MODEL, D_FF, generator=generator) / D_MODEL**0.5
    w_down = torch.randn(N_EXPERTS, D_FF, D_MODEL, generator=generator) / D_FF**0.5
    grad = torch.randn(n_tokens, D_MODEL, generator=generator)
    return [t.to(DEVICE) for t in (x, w_gate, w_up, w_down, grad)]


def offsets_of(*sizes: int) -> torch.Tensor:
    values = [0]
    for size in sizes:
        values.append(values[-1] + size)
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def run(precision, x, offsets, w_gate, w_up, w_down, grad, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    out = grouped_swiglu(leaves[0], offsets, *leaves[1:], precision=precision, **kwargs)
    out.backward(grad.to(out.dtype))
    return [out.detach().float()] + [leaf.grad.float() for leaf in leaves]


def explicit_swiglu(x, offsets, w_gate, w_up, w_down):
    bounds = offsets.tolist()
    rows = []
    for expert in range(N_EXPERTS):
        part = x[bounds[expert] : bounds[expert + 1]]
        rows.append((F.silu(part @ w_gate[expert]) * (part @ w_up[expert])) @ w_down[expert])
    return torch.cat(rows)


def test_fp32_matches_the_per_expert_formula_and_its_gradients():
    x, w_gate, w_up, w_down, grad = make_layer(100)
    offsets = offsets_of(30, 0, 50, 20)
    actual = run("fp32", x, offsets, w_gate, w_up, w_down, grad)
    leaves = [t.clone().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    expected_out = explicit_swiglu(leaves[0], offsets, *leaves[1:])
    expected_out.backward(grad)
    expected = [expected_out.detach()] + [leaf.grad for leaf in leaves]
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(actual[2][1]) == 0  # the empty expert's weights get no gradient


def test_bf16_is_close_to_fp32():
    layer = make_layer(100, seed=1)
    offsets = offsets_of(10, 40, 0, 50)
    fp32 = run("fp32", layer[0], offsets, *layer[1:])
    bf16 = run("bf16", layer[0], offsets, *layer[1:])
    for a, e in zip(bf16, fp32, strict=True):
        assert sqnr_db(e, a) >= 35.0


def test_mxfp8_reference_backward_uses_column_quantization_of_high_precision_tensors():
    x, w_gate, w_up, w_down, grad = make_layer(96, seed=2)
    offsets = offsets_of(40, 0, 33, 23)
    out, _, _, _, grad_w_down = run("mxfp8", x, offsets, w_gate, w_up, w_down, grad, backend="reference")
    fq = fake_quantize_mxfp8
    gate = ref.grouped_mm_reference(fq(x, axis="rows"), fq(w_gate, axis="cols"), offsets)
    up = ref.grouped_mm_reference(fq(x, axis="rows"), fq(w_up, axis="cols"), offsets)
    hidden = F.silu(gate) * up
    expected_out = ref.grouped_mm_reference(fq(hidden, axis="rows"), fq(w_down, axis="cols"), offsets)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    # wgrad of w_down: both operands quantized 32x1 along tokens, per expert, from fp32 tensors.
    expected_grad_w_down = ref.grouped_wgrad_reference(
        fq(hidden, axis="cols", offsets=offsets), fq(grad, axis="cols", offsets=offsets), offsets
    )
    torch.testing.assert_close(grad_w_down, expected_grad_w_down, rtol=1e-5, atol=1e-5)
    # Re-quantizing the row-wise copy instead would be a different (doubly rounded) operand.
    double_rounded = fq(fq(hidden, axis="rows"), axis="cols", offsets=offsets)
    assert not torch.equal(double_rounded, fq(hidden, axis="cols", offsets=offsets))


def test_mxfp8_tracks_fp32_through_forward_and_backward():
    layer = make_layer(256, seed=3)
    offsets = offsets_of(64, 100, 0, 92)
    fp32 = run("fp32", layer[0], offsets, *layer[1:])
    mxfp8 = run("mxfp8", layer[0], offsets, *layer[1:], backend="reference")
    names = ["out", "grad_x", "grad_w_gate", "grad_w_up", "grad_w_down"]
    figures = {name: sqnr_db(e, a) for name, e, a in zip(names, fp32, mxfp8, strict=True)}
    print("\nMXFP8 SwiGLU layer vs fp32 SQNR (dB):", {k: round(v, 2) for k, v in figures.items()})
    # Four to six quantized operands compound along the SwiGLU chain (one GEMM alone is ~28.5 dB).
    assert min(figures.values()) >= 20.0


@requires_triton
def test_triton_backend_matches_reference_backend():
    layer = make_layer(100, seed=4)
    offsets = offsets_of(33, 0, 60, 7)
    reference = run("mxfp8", layer[0], offsets, *layer[1:], backend="reference")
    triton_run = run("mxfp8", layer[0], offsets, *layer[1:], backend="triton")
    for e, a in zip(reference, triton_run, strict=True):
        assert sqnr_db(e, a) >= TRITON_VS_REFERENCE_DB


@requires_triton
def test_triton_backend_forced_by_environment(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV_VAR, "triton")
    assert GroupedSwiGLUConfig(precision="mxfp8").resolved_backend(DEVICE) == "triton"
    layer = make_layer(40, seed=5)
    offsets = offsets_of(40, 0, 0, 0)
    forced = run("mxfp8", layer[0], offsets, *layer[1:])
    reference = run("mxfp8", layer[0], offsets, *layer[1:], backend="reference")
    assert sqnr_db(reference[0], forced[0]) >= TRITON_VS_REFERENCE_DB


def test_bf16_input_under_autocast_keeps_fp32_gemm_numerics():
    x, w_gate, w_up, w_down, grad = make_layer(64, seed=6)
    offsets = offsets_of(16, 16, 16, 16)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        under_autocast = run("mxfp8", x.bfloat16(), offsets, w_gate, w_up, w_down, grad, backend="reference")
    plain = run("mxfp8", x.bfloat16(), offsets, w_gate, w_up, w_down, grad, backend="reference")
    for a, e in zip(under_autocast, plain, strict=True):
        torch.testing.assert_close(a, e)
    assert under_autocast[2].dtype == torch.float32


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("sizes", [(30, 0, 50, 20), (0, 0, 7, 0), (0, 0, 0, 0)])
def test_inference_without_autograd_equals_the_training_path(precision, sizes):
    # Without an autograd graph the experts run as one grouped GEMM call; it must give what the
    # differentiable per-expert path gives, empty experts and an empty batch included.
    x, w_gate, w_up, w_down, _ = make_layer(sum(sizes), seed=3)
    offsets = offsets_of(*sizes)
    with torch.no_grad():
        inference = grouped_swiglu(x, offsets, w_gate, w_up, w_down, precision=precision)
    leaves = [t.clone().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    training = grouped_swiglu(leaves[0], offsets, *leaves[1:], precision=precision).detach()
    assert inference.shape == training.shape == x.shape
    tolerance = {"fp32": (1e-5, 1e-6), "bf16": (1.6e-2, 1e-2)}[precision]
    torch.testing.assert_close(inference, training, rtol=tolerance[0], atol=tolerance[1])


@pytest.mark.parametrize("precision", ["fp32", "bf16", "mxfp8"])
def test_no_tokens_at_all(precision):
    x, w_gate, w_up, w_down, _ = make_layer(0)
    offsets = offsets_of(0, 0, 0, 0)
    out, grad_x, grad_w_gate, _, grad_w_down = run(precision, x, offsets, w_gate, w_up, w_down, torch.zeros(0, D_MODEL, device=DEVICE))
    assert out.shape == (0, D_MODEL) and grad_x.shape == (0, D_MODEL)
    assert torch.count_nonzero(grad_w_gate) == 0 and torch.count_nonzero(grad_w_down) == 0


def test_bad_arguments_get_clear_errors(monkeypatch):
    x, w_gate, w_up, w_down, _ = make_layer(10)
    offsets = offsets_of(10, 0, 0, 0)
    with pytest.raises(ValueError, match="precision='fp8' is unknown"):
        grouped_swiglu(x, offsets, w_gate, w_up, w_down, precision="fp8")
    with pytest.raises(ValueError, match="w_down must be"):
        grouped_swiglu(x, offsets, w_gate, w_up, w_down.transpose(1, 2), precision="fp32")
    with pytest.raises(ValueError, match="offsets must be"):
        grouped_swiglu(x, offsets[:-1], w_gate, w_up, w_down, precision="fp32")
    if DEVICE.type == "cpu":  # CUDA offsets are not read back: that would cost a host sync per layer call
        with pytest.raises(ValueError, match="end at the number of rows"):
            grouped_swiglu(x, offsets_of(5, 0, 0, 0), w_gate, w_up, w_down, precision="fp32")
    with pytest.raises(ValueError, match="multiples of 32"):
        grouped_swiglu(x[:, :40], offsets, w_gate[:, :40], w_up[:, :40], w_down[:, :, :40], precision="mxfp8")
    with pytest.raises(ValueError, match="backend='cuda' is unknown"):
        grouped_swiglu(x, offsets, w_gate, w_up, w_down, precision="mxfp8", backend="cuda")
    monkeypatch.setenv(BACKEND_ENV_VAR, "fast")
    with pytest.raises(ValueError, match="FLOWSTATE_MXFP8_BACKEND='fast' is unknown"):
        grouped_swiglu(x, offsets, w_gate, w_up, w_down, precision="mxfp8")
    monkeypatch.delenv(BACKEND_ENV_VAR)
    if DEVICE.type == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match="needs the Triton interpreter"):
            grouped_swiglu(x, offsets, w_gate, w_up, w_down, precision="mxfp8", backend="triton")


def test_model_trains_with_mxfp8_experts():
    model_module = pytest.importorskip("training.model.transformer")
    config_module = pytest.importorskip("training.model.config")
    torch.manual_seed(0)
    config = config_module.ModelConfig.named("tiny", precision="mxfp8", n_layers=1, vocab_size=256)
    model = model_module.MoETransformer(config)
    input_ids = torch.randint(0, 256, (2, 24))
    logits = model(input_ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 256), input_ids[:, 1:].reshape(-1))
    loss.backward()
    expert_grads = [model.layers[0].feed_forward.w_gate.grad, model.layers[0].feed_forward.w_down.grad]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in expert_grads)
