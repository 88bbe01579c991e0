"""Write side of the model registry: import a Hugging Face directory, export a registered model."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils.text import slugify

from training.hf.directory import checksum, copy_files, inspect_directory, kept_files
from training.hf.gguf import gguf_file_of, gguf_to_hf_directory, inspect_gguf
from training.hf.loading import DTYPES, load_hf_model, save_hf_model
from webapp.accounts.models import Team
from webapp.registry.models import RegisteredModel


class RegistryError(ValueError):
    """An import or export the registry refuses; the message says why."""


def import_model(
    *,
    source: str | Path,
    name: str,
    owner: AbstractBaseUser | None = None,
    team: Team | None = None,
    verify_weights: bool = True,
    dtype: str = "float32",
) -> RegisteredModel:
    """Validate `source`, copy its files under settings.MODELS_ROOT/<name> and register it.

    `source` is a Hugging Face directory, a GGUF file, or a directory holding one GGUF file; a GGUF file
    is dequantised to `dtype` first (training.hf.gguf) and its own checksum recorded. verify_weights loads
    every tensor into Flowstate's model (shard by shard, in the checkpoint's dtype) so a missing or
    mis-shaped tensor is refused at import rather than at first use.
    """
    source = Path(source).resolve()
    if slugify(name) != name:
        raise RegistryError(f"Model name {name!r} must be a slug (letters, digits, '-' and '_'): e.g. {slugify(name)!r}.")
    if RegisteredModel.objects.filter(name=name).exists():
        raise RegistryError(f"A model named {name!r} is already registered; choose another name.")
    destination = Path(settings.MODELS_ROOT) / name
    if destination.exists():
        raise RegistryError(f"{destination} already exists; remove it or choose another name.")
    gguf_path = gguf_file_of(source)
    if gguf_path is None:
        return _register_directory(
            directory=source, name=name, owner=owner, team=team, verify_weights=verify_weights,
            recorded={"source": str(source), "source_format": "hf"},
        )
    report = inspect_gguf(gguf_path)
    Path(settings.MODELS_ROOT).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=settings.MODELS_ROOT, prefix=f".{name}.gguf-") as scratch:
        converted = gguf_to_hf_directory(report, Path(scratch) / "hf", dtype=dtype)
        return _register_directory(
            directory=converted, name=name, owner=owner, team=team, verify_weights=verify_weights,
            recorded={"source": str(gguf_path), "source_format": "gguf", "source_checksum": report.sha256},
        )


def _register_directory(
    *, directory: Path, name: str, owner, team, verify_weights: bool, recorded: dict[str, str]
) -> RegisteredModel:
    report = inspect_directory(directory)
    if verify_weights:
        model, _, _ = load_hf_model(directory)
        del model
    files = kept_files(directory, report)
    destination = Path(settings.MODELS_ROOT) / name
    size = copy_files(files, destination)
    try:
        with transaction.atomic():
            return RegisteredModel.objects.create(
                name=name,
                family=report.family,
                total_parameters=report.parameter_counts["total"],
                active_parameters=report.parameter_counts["active"],
                dtype=report.dtype,
                checksum=checksum(files),
                directory=str(destination),
                size_bytes=size,
                owner=owner,
                team=team,
                **recorded,
            )
    except Exception:
        shutil.rmtree(destination, ignore_errors=True)
        raise


def export_model(*, model: RegisteredModel, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Write `model` as a Hugging Face directory transformers loads (weights re-saved from Flowstate's model,
    tokenizer and generation files copied)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise RegistryError(f"{out_dir} is not empty; export into a new or empty directory.")
    if dtype is not None and dtype not in DTYPES:
        raise RegistryError(f"dtype {dtype!r} is unknown; use one of {sorted(DTYPES)}.")
    source = Path(model.directory)
    flowstate_model, hf_config, _ = load_hf_model(source)
    save_hf_model(flowstate_model, hf_config, out_dir, dtype=DTYPES[dtype] if dtype else None)
    report = inspect_directory(source)
    for path in kept_files(source, report):
        if not path.name.endswith(".safetensors") and path.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copyfile(path, out_dir / path.name)
    return out_dir
