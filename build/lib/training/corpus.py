"""Code corpus for the tokenizer and pretraining: this interpreter's stdlib sources plus optional dirs."""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Vendored and generated trees that are not representative code (or are huge test fixtures).
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "idlelib", "test", "tests"})


@dataclass
class CorpusConfig:
    """Which source files make up the corpus and how much of it to read."""

    extra_dirs: tuple[str, ...] = ()
    """Directories scanned in addition to the stdlib (e.g. the project's own sources)."""

    include_stdlib: bool = True
    """Read the CPython standard library of the running interpreter (sysconfig "stdlib" path)."""

    suffixes: tuple[str, ...] = (".py",)
    """File name endings to read."""

    max_bytes: int | None = None
    """Stop after this many UTF-8 bytes of text (None reads everything)."""

    max_file_bytes: int = 200_000
    """Skip single files larger than this (generated tables dominate otherwise)."""

    shuffle_seed: int | None = 0
    """Deterministic file order shuffle so a byte cap samples many modules; None keeps sorted order."""

    skipped_dir_names: frozenset[str] = field(default_factory=lambda: _SKIPPED_DIRS)
    """Directory names never descended into."""

    def __post_init__(self) -> None:
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive or None, got {self.max_bytes}.")
        if not self.include_stdlib and not self.extra_dirs:
            raise ValueError("The corpus is empty: set include_stdlib=True or give extra_dirs.")
        for directory in self.extra_dirs:
            if not Path(directory).is_dir():
                raise ValueError(f"Corpus directory {directory!r} does not exist or is not a directory.")


@dataclass(frozen=True)
class CorpusDocument:
    path: str
    text: str


def corpus_roots(config: CorpusConfig) -> list[Path]:
    roots = [Path(sysconfig.get_paths()["stdlib"])] if config.include_stdlib else []
    return roots + [Path(directory) for directory in config.extra_dirs]


def corpus_files(config: CorpusConfig) -> list[Path]:
    """All candidate files in a deterministic order."""
    files: list[Path] = []
    for root in corpus_roots(config):
        for path in sorted(root.rglob("*")):
            relative_parts = path.relative_to(root).parts[:-1]
            if any(part in config.skipped_dir_names for part in relative_parts):
                continue
            if path.suffix in config.suffixes and path.is_file():
                files.append(path)
    if config.shuffle_seed is not None:
        random.Random(config.shuffle_seed).shuffle(files)
    return files


def iter_documents(config: CorpusConfig) -> Iterator[CorpusDocument]:
    """Yield decodable source files until max_bytes of text has been produced."""
    remaining = config.max_bytes
    for path in corpus_files(config):
        try:
            if path.stat().st_size > config.max_file_bytes:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if remaining is not None:
            encoded = text.encode("utf-8")
            if len(encoded) >= remaining:
                yield CorpusDocument(str(path), encoded[:remaining].decode("utf-8", errors="ignore"))
                return
            remaining -= len(encoded)
        yield CorpusDocument(str(path), text)
