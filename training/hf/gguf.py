"""GGUF files (llama.cpp's format) as a source of Hugging Face model directories.

A GGUF file holds quantised weights, the tokenizer and the chat template in one file. Flowstate trains and
serves full-precision weights, so an import dequantises the file once, through transformers' own GGUF
loader (packages ``gguf`` and ``transformers``), into a Hugging Face directory in the dtype asked for:
``config.json``, ``model.safetensors``, the fast tokenizer and the chat template. Everything after that
(the family check, the weight check, serving, training) reads the directory like any other import.

Refused before anything is converted, with the reason named: a file that is not GGUF, an architecture
transformers cannot convert or Flowstate cannot load, and a tensor quantisation the ``gguf`` package
cannot dequantise.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from training.hf.families import SUPPORTED_FAMILIES, UnsupportedModelError
from training.hf.loading import DTYPES, HFDirectoryError

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
PLAIN_TYPES = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})
"""Tensor types stored unquantised; every other type must be one the gguf package dequantises."""


class GGUFError(HFDirectoryError):
    """A GGUF file Flowstate cannot import; the message names the file and the reason."""


@dataclass(frozen=True)
class GGUFReport:
    """What an importable GGUF file holds, read from its header without dequantising anything."""

    path: Path
    """The file."""

    architecture: str
    """``general.architecture`` (llama, qwen2, qwen3, qwen3_moe, ...)."""

    tensor_types: tuple[str, ...]
    """The distinct ggml tensor types of its weights (F32, Q4_1, Q8_0, ...)."""

    sha256: str
    """Digest of the file's bytes, recorded as the import's source checksum."""


def gguf_file_of(source: Path) -> Path | None:
    """The GGUF file `source` names: the file itself, or the one ``*.gguf`` of a directory without a
    config.json. None when `source` is a Hugging Face directory (or not GGUF at all)."""
    if source.is_file():
        return source if source.suffix.lower() == GGUF_SUFFIX else None
    if not source.is_dir() or (source / "config.json").is_file():
        return None
    found = sorted(path for path in source.iterdir() if path.suffix.lower() == GGUF_SUFFIX and path.is_file())
    if len(found) > 1:
        names = ", ".join(path.name for path in found)
        raise GGUFError(f"{source} holds several GGUF files ({names}); name the one to import.")
    return found[0] if found else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(8 * 1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


def _field_text(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def inspect_gguf(path: Path) -> GGUFReport:
    """Check that `path` is a GGUF file whose architecture and quantisations can be imported."""
    import gguf
    from gguf.quants import _type_traits as dequantisable
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    with path.open("rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes).")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as error:
        raise GGUFError(f"{path} is not a readable GGUF file: {error}") from error
    architecture = _field_text(reader, "general.architecture")
    if architecture is None:
        raise GGUFError(f"{path} has no general.architecture field.")
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES or architecture not in SUPPORTED_FAMILIES:
        loadable = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) & set(SUPPORTED_FAMILIES))
        raise UnsupportedModelError(
            f"{path} holds a {architecture!r} model; GGUF imports support: {', '.join(loadable)}."
        )
    supported = PLAIN_TYPES | {qtype.name for qtype in dequantisable}
    types = tuple(sorted({tensor.tensor_type.name for tensor in reader.tensors}))
    unsupported = [name for name in types if name not in supported]
    if unsupported:
        raise GGUFError(
            f"{path} uses the quantisation {', '.join(unsupported)}, which cannot be dequantised here; "
            f"supported: {', '.join(sorted(supported))}."
        )
    return GGUFReport(path=path, architecture=architecture, tensor_types=types, sha256=_sha256(path))


def gguf_to_hf_directory(report: GGUFReport, out_dir: Path, *, dtype: str = "float32") -> Path:
    """Dequantise `report.path` into a Hugging Face directory `out_dir` (created) with weights in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise GGUFError(f"dtype {dtype!r} is unknown; use one of {sorted(DTYPES)}.")
    directory, name = str(report.path.parent), report.path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    if not tokenizer.chat_template:
        raise GGUFError(f"{report.path} has no tokenizer.chat_template; Flowstate renders chats with it.")
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=DTYPES[dtype])
    # A model loaded from GGUF refuses save_pretrained (it remembers its quantised source), so its
    # weights move into a fresh model of the same class and config, which saves as plain safetensors.
    config = loaded.config
    config.dtype = DTYPES[dtype]
    with torch.device("meta"):
        fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict(), assign=True)
    fresh.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=False)
    fresh.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
