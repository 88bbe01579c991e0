"""Fixtures for semantic search tests: tiny real repositories, real local sandboxes, a tmp index root."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

TINY_REPOSITORY = {
    "app/durations.py": (
        "import re\n"
        "\n"
        "UNITS = {'s': 1, 'm': 60, 'h': 3600}\n"
        "\n"
        "\n"
        "def parse_duration(text):\n"
        "    number, unit = re.fullmatch(r'(\\d+)([smh])', text).groups()\n"
        "    return int(number) * UNITS[unit]\n"
    ),
    "app/cache.py": (
        "class LruCache:\n"
        "    def __init__(self, capacity):\n"
        "        self.capacity = capacity\n"
        "        self.items = {}\n"
        "\n"
        "    def evict_least_recently_used(self):\n"
        "        oldest = min(self.items, key=lambda key: self.items[key][1])\n"
        "        del self.items[oldest]\n"
    ),
    "app/geometry.py": (
        "import math\n"
        "\n"
        "\n"
        "def circle_area(radius):\n"
        "    return math.pi * radius ** 2\n"
    ),
    "docs/deploy.md": "# Deploying\n\nBuild the image and start the containers with docker compose up.\n",
    "assets/logo.bin": "\x00\x01binary",
}


@pytest.fixture
def tiny_repository(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for relative, content in TINY_REPOSITORY.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return root


@pytest.fixture(scope="session")
def encoder_cache(tmp_path_factory) -> Path:
    """One ONNX export per test session (the export is the slow part of the first fast-path encode)."""
    return tmp_path_factory.mktemp("semantic-encoders")


@pytest.fixture
def search_config(tmp_path: Path, encoder_cache: Path):
    """Waits for the index on the first search (``test_background_index.py`` covers the BM25 stand-in)."""
    from sandboxes.semantic.config import SemanticSearchConfig

    return SemanticSearchConfig(index_root=tmp_path / "index", vector_store="memory", encoder_cache_dir=encoder_cache,
                                background_indexing=False)


@pytest.fixture
def local_backend():
    from sandboxes.base import BackendUnavailable
    from sandboxes.local_backend import LocalBackend, LocalBackendConfig

    # pytest's tmp_path sits under a 0700 directory that the sandbox's mapped uids cannot traverse.
    root = Path(tempfile.mkdtemp(prefix="flowstate-semantic-"))
    root.chmod(0o755)
    try:
        yield LocalBackend(LocalBackendConfig(root=root))
    except BackendUnavailable as exc:
        pytest.skip(f"local sandbox backend unavailable here: {exc}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
