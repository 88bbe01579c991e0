"""Checks and copies of a Hugging Face model directory (the files import_model reads and keeps)."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.hf.families import config_from_hf, family_of
from training.hf.loading import CONFIG_FILE, HFDirectoryError, checkpoint_dtype, read_hf_config
from training.hf.weights import INDEX_FILE, shard_files

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
OPTIONAL_FILES = (GENERATION_CONFIG_FILE, CHAT_TEMPLATE_FILE, "special_tokens_map.json")
CHUNK = 8 * 1024 * 1024


@dataclass
class DirectoryReport:
    """What a valid Hugging Face directory holds."""

    hf_config: dict[str, Any]
    """config.json as a dict."""

    family: str
    """Its model_type."""

    dtype: str
    """Declared dtype of the weights (float32, bfloat16, float16)."""

    weight_files: list[Path]
    """The safetensors shards (or the single model.safetensors)."""

    parameter_counts: dict[str, int]
    """{"total": ..., "active": ...} of the model."""

    chat_template: str
    """The Jinja chat template (tokenizer_config.json's, or chat_template.jinja's)."""


def read_chat_template(directory: Path) -> str:
    """The model's chat template; HFDirectoryError names the file that is missing or lacks it."""
    config_path = directory / TOKENIZER_CONFIG_FILE
    if not config_path.is_file():
        raise HFDirectoryError(f"{config_path} is missing: the chat template and special tokens live there.")
    try:
        tokenizer_config = json.loads(config_path.read_text())
    except ValueError as error:
        raise HFDirectoryError(f"{config_path} is not valid JSON: {error}") from error
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not template and (directory / CHAT_TEMPLATE_FILE).is_file():
        template = (directory / CHAT_TEMPLATE_FILE).read_text()
    if not isinstance(template, str) or not template.strip():
        raise HFDirectoryError(
            f"{config_path} has no chat_template (and there is no {CHAT_TEMPLATE_FILE}); Flowstate renders "
            "conversations with the model's own template."
        )
    return template


def inspect_directory(directory: str | Path) -> DirectoryReport:
    """Validate a Hugging Face directory without loading its weights; errors name the offending file."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HFDirectoryError(f"{directory} is not a directory.")
    hf_config = read_hf_config(directory)
    family = family_of(hf_config)
    config = config_from_hf(hf_config)
    tokenizer_path = directory / TOKENIZER_FILE
    if not tokenizer_path.is_file():
        raise HFDirectoryError(f"{tokenizer_path} is missing: Flowstate needs the model's fast tokenizer file.")
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(tokenizer_path))
    except Exception as error:  # tokenizers raises a bare Exception for unreadable files
        raise HFDirectoryError(f"{tokenizer_path} is not a readable tokenizer: {error}") from error
    template = read_chat_template(directory)
    return DirectoryReport(
        hf_config=hf_config,
        family=family.model_type,
        dtype=checkpoint_dtype(hf_config),
        weight_files=shard_files(directory),
        parameter_counts=config.parameter_counts(),
        chat_template=template,
    )


def kept_files(directory: Path, report: DirectoryReport) -> list[Path]:
    """The files an import copies: config, index, shards, tokenizer files and optional extras."""
    names = [CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, *OPTIONAL_FILES]
    if (directory / INDEX_FILE).is_file():
        names.append(INDEX_FILE)
    files = [directory / name for name in names if (directory / name).is_file()]
    return files + list(report.weight_files)


def checksum(files: list[Path]) -> str:
    """SHA-256 over the files' names and bytes, in the given order (read in 8 MiB chunks)."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def copy_files(files: list[Path], destination: Path) -> int:
    """Copy the files into `destination` (created); returns the bytes copied."""
    destination.mkdir(parents=True, exist_ok=False)
    total = 0
    for path in files:
        shutil.copyfile(path, destination / path.name)
        total += path.stat().st_size
    return total
