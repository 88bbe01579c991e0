"""manage.py import_model / export_model accept a DeepSeek-V3 directory: family, parameter counts, round trip."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from django.core.management import CommandError, call_command

from tests.training.hf.hf_models import padded_batch, save_hf_directory
from webapp.registry.models import RegisteredModel

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("src") / "deepseek-v3-tiny"
    return directory, save_hf_directory("deepseek_v3", directory)


@pytest.fixture
def models_root(settings, tmp_path):
    settings.MODELS_ROOT = tmp_path / "models"
    return settings.MODELS_ROOT


def _unrouted_parameters(reference) -> int:
    """Parameters of the routed experts a token does not use, counted from transformers' own modules."""
    config = reference.config
    unrouted = 0
    for layer in reference.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            per_expert = sum(p.numel() for p in experts.parameters()) // config.n_routed_experts
            unrouted += (config.n_routed_experts - config.num_experts_per_tok) * per_expert
    return unrouted


def test_import_deepseek_counts_total_and_active_parameters(db, deepseek_dir, models_root):
    directory, reference = deepseek_dir
    call_command("import_model", str(directory), "--name", "deepseek-tiny")
    model = RegisteredModel.objects.get(name="deepseek-tiny")
    total = sum(p.numel() for p in reference.parameters())
    assert model.family == "deepseek_v3" and model.total_parameters == total
    # 2 MoE layers (the first is dense) x 6 unrouted experts x 3 x 64 x 32
    assert _unrouted_parameters(reference) == 2 * 6 * 3 * 64 * 32
    assert model.active_parameters == total - _unrouted_parameters(reference)


def test_export_deepseek_reloads_in_transformers_with_identical_logits(db, deepseek_dir, models_root, tmp_path):
    directory, reference = deepseek_dir
    call_command("import_model", str(directory), "--name", "deepseek-export")
    out = tmp_path / "out"
    call_command("export_model", "deepseek-export", str(out))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == "DeepseekV3ForCausalLM"
    ids, mask = padded_batch(reloaded.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids, attention_mask=mask).logits,
                           reference(input_ids=ids, attention_mask=mask).logits)


def test_import_refuses_an_fp8_deepseek_naming_the_option(db, deepseek_dir, models_root, tmp_path):
    source = tmp_path / "fp8"
    shutil.copytree(deepseek_dir[0], source)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(CommandError, match="quantization_config"):
        call_command("import_model", str(source), "--name", "fp8")
    assert not RegisteredModel.objects.exists()


def test_served_deepseek_parses_its_tool_call_tokens(tmp_path):
    """HFChatModel on a DeepSeek-V3 directory with DeepSeek's template and special tokens: the tool calls it would
    generate come back as OpenAI tool_calls, and streamed content stops at the tool-call token."""
    from tests.training.hf.hf_models import DEEPSEEK_TEMPLATE, write_tokenizer_files
    from training.engine import GenerationResult
    from training.hf.serving import HFChatModel

    directory = tmp_path / "deepseek-chat"
    save_hf_directory("deepseek_v3", directory)
    write_tokenizer_files(directory, DEEPSEEK_TEMPLATE, deepseek=True)
    # the tiny config keeps DeepSeek's ids (bos 0, eos 1), which are byte tokens of this tokenizer: point them at
    # its own special tokens, as a real checkpoint's are
    specials = {t["content"]: t["id"] for t in json.loads((directory / "tokenizer.json").read_text())["added_tokens"]}
    for name in ("config.json", "generation_config.json"):
        config = json.loads((directory / name).read_text())
        config.update(bos_token_id=specials["<｜begin▁of▁sentence｜>"], eos_token_id=specials["<｜end▁of▁sentence｜>"])
        (directory / name).write_text(json.dumps(config))
    chat_model = HFChatModel(directory, name="deepseek-chat")
    try:
        assert chat_model.chat.tool_style == "deepseek"
        tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
        reply = {"role": "assistant", "content": "Looking.", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "read_file", "arguments": json.dumps({"path": "a.py"})}}]}
        messages = [{"role": "user", "content": "read a.py"}]
        ids = chat_model.hf_tokenizer.encode(chat_model.chat.render_assistant(messages, reply, tools=tools),
                                             add_special_tokens=False).ids
        assert chat_model.hf_tokenizer.token_to_id("<｜tool▁calls▁begin｜>") in ids and ids[-1] in chat_model.stop_ids
        assert chat_model._visible_content(ids) == "Looking."
        prompt = chat_model._prompt_ids(messages, tools)
        completion = chat_model._completion(GenerationResult(0, prompt, ids, [0.0] * len(ids), "stop", None))
        assert completion.finish_reason == "tool_calls" and completion.parse_error is None
        assert completion.content == "Looking."
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in completion.tool_calls] == [
            ("read_file", {"path": "a.py"})]
    finally:
        chat_model.close()
