"""Write side of the model registry: import a Hugging Face directory, export a registered model."""

from __future__ import annotations

import shutil
from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils.text import slugify

from training.hf.directory import checksum, copy_files, inspect_directory, kept_files
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
) -> RegisteredModel:
    """Validate `source`, copy its files under settings.MODELS_ROOT/<name> and register it.

    verify_weights loads every tensor into Flowstate's model (shard by shard, in the checkpoint's dtype) so a
    missing or mis-shaped tensor is refused at import rather than at first use.
    """
    source = Path(source).resolve()
    if slugify(name) != name:
        raise RegistryError(f"Model name {name!r} must be a slug (letters, digits, '-' and '_'): e.g. {slugify(name)!r}.")
    if RegisteredModel.objects.filter(name=name).exists():
        raise RegistryError(f"A model named {name!r} is already registered; choose another name.")
    report = inspect_directory(source)
    if verify_weights:
        model, _, _ = load_hf_model(source)
        del model
    files = kept_files(source, report)
    destination = Path(settings.MODELS_ROOT) / name
    if destination.exists():
        raise RegistryError(f"{destination} already exists; remove it or choose another name.")
    size = copy_files(files, destination)
    try:
        with transaction.atomic():
            return RegisteredModel.objects.create(
                name=name,
                family=report.family,
                total_parameters=report.parameter_counts["total"],
                active_parameters=report.parameter_counts["active"],
                dtype=report.dtype,
                source=str(source),
                checksum=checksum(files),
                directory=str(destination),
                size_bytes=size,
                owner=owner,
                team=team,
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
