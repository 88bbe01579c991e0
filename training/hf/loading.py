"""Build a MoETransformer from a Hugging Face directory, and write one back as a Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from training.hf.families import Family, config_from_hf, family_of
from training.hf.weights import load_weights, save_weights
from training.model.transformer import MoETransformer

CONFIG_FILE = "config.json"
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFDirectoryError(ValueError):
    """A Hugging Face directory with a missing or unreadable file; the message names the file."""


def read_hf_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise HFDirectoryError(f"{path} is missing: a Hugging Face model directory needs its config.json.")
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        raise HFDirectoryError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise HFDirectoryError(f"{path} must hold a JSON object.")
    return data


def checkpoint_dtype(hf_config: dict[str, Any]) -> str:
    """The dtype name the checkpoint declares (torch_dtype in v4 configs, dtype in v5), default float32."""
    name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32").removeprefix("torch.")
    return name if name in DTYPES else "float32"


def load_hf_model(
    directory: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[MoETransformer, dict[str, Any], Family]:
    """(model, config.json dict, family) of a Hugging Face directory, weights streamed shard by shard.

    dtype: parameter dtype (default: the checkpoint's own). The model is built without initialising its
    weights, so memory peaks near the model's size.
    """
    directory = Path(directory)
    hf_config = read_hf_config(directory)
    family = family_of(hf_config)
    config = config_from_hf(hf_config)
    with torch.device("meta"):
        model = MoETransformer(config)
    model = model.to(dtype or DTYPES[checkpoint_dtype(hf_config)]).materialize(device)
    load_weights(model, directory, family)
    return model.eval(), hf_config, family


def save_hf_model(
    model: MoETransformer,
    hf_config: dict[str, Any],
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> list[Path]:
    """Write config.json and the weights (sharded past max_shard_bytes) of `model` into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    family = family_of(hf_config)
    dtype = dtype or next(model.parameters()).dtype
    dtype_name = next(name for name, value in DTYPES.items() if value == dtype)
    config = {**hf_config, "torch_dtype": dtype_name}
    config.pop("dtype", None)
    paths = save_weights(model, directory, family, dtype=dtype, max_shard_bytes=max_shard_bytes)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    return paths
