"""manage.py import_model / export_model, the registry's visibility and the Models page."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from django.core.management import CommandError, call_command

from tests.training.hf.hf_models import padded_batch, save_hf_directory
from webapp.registry.models import RegisteredModel
from webapp.registry.selectors import registered_models_visible_to

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("src") / "qwen3-moe-tiny"
    reference = save_hf_directory("qwen3_moe", directory)
    return directory, reference


@pytest.fixture
def models_root(settings, tmp_path):
    settings.MODELS_ROOT = tmp_path / "models"
    return settings.MODELS_ROOT


def test_import_registers_counts_checksum_and_copies_files(db, qwen3_moe_dir, models_root, capsys):
    directory, reference = qwen3_moe_dir
    call_command("import_model", str(directory), "--name", "qwen3-moe-tiny")
    model = RegisteredModel.objects.get(name="qwen3-moe-tiny")
    assert model.family == "qwen3_moe" and model.dtype == "float32" and model.owner is None
    assert model.total_parameters == sum(p.numel() for p in reference.parameters())
    assert model.active_parameters < model.total_parameters
    assert len(model.checksum) == 64
    assert {p.name for p in (models_root / "qwen3-moe-tiny").iterdir()} >= {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert "Registered qwen3-moe-tiny" in capsys.readouterr().out
    with pytest.raises(CommandError, match="already registered"):
        call_command("import_model", str(directory), "--name", "qwen3-moe-tiny")


def test_export_reloads_in_transformers_with_identical_logits(db, qwen3_moe_dir, models_root, tmp_path):
    directory, reference = qwen3_moe_dir
    call_command("import_model", str(directory), "--name", "exported")
    out = tmp_path / "out"
    call_command("export_model", "exported", str(out))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids, mask = padded_batch(reloaded.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids, attention_mask=mask).logits,
                           reference(input_ids=ids, attention_mask=mask).logits)
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template


def test_sharded_import_and_export(db, qwen3_moe_dir, models_root, tmp_path):
    directory, reference = qwen3_moe_dir
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, safe_serialization=True, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (directory / name).exists():
            shutil.copyfile(directory / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").exists()
    call_command("import_model", str(sharded), "--name", "sharded")
    assert RegisteredModel.objects.get(name="sharded").size_bytes > 0
    out = tmp_path / "out"
    from webapp.registry.services import export_model

    export_model(model=RegisteredModel.objects.get(name="sharded"), out_dir=out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids, mask = padded_batch(reloaded.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ("tokenizer.json", "tokenizer.json is missing"),
        ("tokenizer_config.json", "tokenizer_config.json is missing"),
        ("model_type", "model_type='gpt2'.*supported families: llama, qwen2, qwen3, qwen3_moe, olmoe, mixtral"),
        ("shard", "model.safetensors is not a readable safetensors file"),
        ("template", "tokenizer_config.json has no chat_template"),
    ],
)
def test_import_errors_name_the_file(db, qwen3_moe_dir, models_root, tmp_path, broken, message):
    source = tmp_path / "broken"
    shutil.copytree(qwen3_moe_dir[0], source)
    if broken in ("tokenizer.json", "tokenizer_config.json"):
        (source / broken).unlink()
    elif broken == "model_type":
        config = json.loads((source / "config.json").read_text())
        (source / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    elif broken == "shard":
        (source / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    else:
        config = json.loads((source / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (source / "tokenizer_config.json").write_text(json.dumps(config))
        (source / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(CommandError, match=message):
        call_command("import_model", str(source), "--name", "broken")
    assert not RegisteredModel.objects.exists()
    assert not (models_root / "broken").exists()


def _register(name, **fields):
    return RegisteredModel.objects.create(
        name=name, family="qwen3", total_parameters=1, active_parameters=1, dtype="float32", source="/src",
        checksum="0" * 64, directory="/nowhere", **fields,
    )


def test_visibility_owner_teammate_outsider(owner, teammate, outsider, team, client):
    _register("shared-by-operator")
    _register("team-model", owner=owner, team=team)
    _register("private-model", owner=owner)
    names = {user.username: set(registered_models_visible_to(user=user).values_list("name", flat=True))
             for user in (owner, teammate, outsider)}
    assert names["owner"] == {"shared-by-operator", "team-model", "private-model"}
    assert names["teammate"] == {"shared-by-operator", "team-model"}
    assert names["outsider"] == {"shared-by-operator"}
    client.force_login(outsider)
    page = client.get("/models/").content.decode()
    assert "shared-by-operator" in page and "team-model" not in page and "private-model" not in page
    client.force_login(teammate)
    page = client.get("/models/").content.decode()
    assert "team-model" in page and "private-model" not in page
    client.logout()
    assert client.get("/models/").status_code == 302
