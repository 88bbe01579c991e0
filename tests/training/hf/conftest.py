"""Session fixture: tiny random Hugging Face checkpoints of every family, saved once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.training.hf.hf_models import ALL_FAMILIES, save_hf_directory


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """model_type -> (saved directory, the transformers model), built once per session."""
    root = tmp_path_factory.mktemp("hf")
    made = {}
    for model_type in ALL_FAMILIES:
        directory = root / model_type
        model = save_hf_directory(model_type, directory)
        made[model_type] = (directory, model)
    return made


