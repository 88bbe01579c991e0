"""An imported model as a policy under training: its tokenizer files travel with every checkpoint.

A training checkpoint (training.checkpoint / training.train.state) of an imported model holds the usual
model.safetensors + config.json (Flowstate's names and config) and, in the subdirectory ``hf/``, the model's
own files: tokenizer.json, tokenizer_config.json (chat template, special tokens), generation_config.json,
chat_template.jinja, special_tokens_map.json when present, and the Hugging Face config.json. So a checkpoint
resumes, serves (training.hf.serving.HFChatModel) and exports back to a Hugging Face directory
(``export_checkpoint``) without the registered model's directory.

``HFTokenizer`` is what training code holds where it holds a BPETokenizer for the built-in model: pad_id,
vocab_size, encode/decode, stop_token_ids, plus ``chat`` (the model's template and tool-call syntax).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from training.hf.chat import HFChatFormat
from training.hf.directory import (
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
)
from training.hf.loading import CONFIG_FILE, HFDirectoryError, read_hf_config

HF_SUBDIR = "hf"
"""Subdirectory of a Flowstate checkpoint holding an imported model's own files."""
TOKENIZER_KIND = "hf"
"""Value of a checkpoint's meta["tokenizer"] when its tokenizer is an imported model's."""
CARRIED_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, GENERATION_CONFIG_FILE, CHAT_TEMPLATE_FILE,
                 "special_tokens_map.json")
"""The files (besides config.json) a checkpoint carries from the imported model's directory."""


class HFTokenizer:
    """An imported model's tokenizer, chat template, stop tokens and Hugging Face config, held in memory
    (so a checkpoint pruned after loading does not take them away)."""

    def __init__(self, *, files: dict[str, bytes], hf_config: dict[str, Any], source: Path) -> None:
        from tokenizers import Tokenizer

        from training.hf.serving import stop_token_ids

        self.files = dict(files)
        self.hf_config = dict(hf_config)
        self.backend = Tokenizer.from_str(self.files[TOKENIZER_FILE].decode())
        self.chat = HFChatFormat.from_directory(source)
        self.stop_token_ids: tuple[int, ...] = stop_token_ids(source, self.backend, self.chat)
        pad = self.chat.special_tokens.get("pad_token")
        pad_id = self.backend.token_to_id(pad) if pad else None
        self.pad_id: int = pad_id if pad_id is not None else (self.stop_token_ids or (0,))[0]

    @classmethod
    def from_directory(cls, directory: str | Path) -> HFTokenizer:
        """Read a Hugging Face directory's (or a checkpoint's ``hf/``) tokenizer files; errors name the file."""
        directory = Path(directory)
        if not (directory / TOKENIZER_FILE).is_file():
            raise HFDirectoryError(f"{directory / TOKENIZER_FILE} is missing: the imported model's tokenizer.")
        files = {name: (directory / name).read_bytes() for name in CARRIED_FILES if (directory / name).is_file()}
        return cls(files=files, hf_config=read_hf_config(directory), source=directory)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as the template's pieces are encoded for the model (no added bos/eos)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """A fingerprint of the files (two checkpoints share a tokenizer when these are equal)."""
        return json.dumps({name: hashlib.sha256(data).hexdigest() for name, data in sorted(self.files.items())})

    def save(self, directory: str | Path) -> Path:
        """Write the carried files and the Hugging Face config.json into `directory` (created)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            (directory / name).write_bytes(data)
        (directory / CONFIG_FILE).write_text(json.dumps(self.hf_config, indent=2, sort_keys=True))
        return directory


def is_hf_tokenizer(tokenizer: Any) -> bool:
    return isinstance(tokenizer, HFTokenizer)


def is_hf_directory(directory: str | Path) -> bool:
    """A Hugging Face model directory (config.json with a model_type), not a Flowstate checkpoint."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        return False
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return False
    return isinstance(data, dict) and "model_type" in data and "format_version" not in data


def load_hf_policy(directory: str | Path, *, device="cpu", precision: str | None = None):
    """(model in fp32, HFTokenizer, meta) of a Hugging Face directory, as load_checkpoint answers.

    precision: the expert matmuls' numerics ("fp32", "bf16", "mxfp8"); None keeps fp32.
    """
    import torch

    from training.hf.loading import load_hf_model

    model, _, family = load_hf_model(directory, dtype=torch.float32, device=device)
    if precision is not None and precision != model.config.precision:
        model = with_precision(model, precision)
    tokenizer = HFTokenizer.from_directory(directory)
    meta = {"source": "huggingface", "family": family.model_type, "name": Path(directory).resolve().name}
    return model, tokenizer, meta


def with_precision(model, precision: str):
    """`model` with its expert matmuls in `precision` (a ModelConfigError names a width mxfp8 cannot block)."""
    import dataclasses

    import torch

    from training.model.transformer import MoETransformer

    config = dataclasses.replace(model.config, precision=precision)
    with torch.device("meta"):
        rebuilt = MoETransformer(config)
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    rebuilt = rebuilt.to(dtype).materialize(device)
    rebuilt.load_state_dict(model.state_dict(), strict=False)
    missing = [name for name, _ in rebuilt.named_parameters() if name not in model.state_dict()]
    if missing:
        raise ValueError(f"parameters {missing} have no value after changing precision")
    return rebuilt.train(model.training)


def export_checkpoint(checkpoint: str | Path, output: str | Path, *, dtype=None) -> list[Path]:
    """Write a checkpoint of an imported model as a Hugging Face directory (weights in the family's names,
    its config.json, tokenizer files and chat template) that transformers and HF servers load."""
    from training.checkpoint import CheckpointError, load_checkpoint
    from training.hf.loading import save_hf_model

    model, tokenizer, _ = load_checkpoint(checkpoint)
    if not is_hf_tokenizer(tokenizer):
        raise CheckpointError(
            f"{checkpoint} is a checkpoint of the built-in model (its tokenizer is Flowstate's); only checkpoints "
            "of imported Hugging Face models export to a Hugging Face directory."
        )
    output = Path(output)
    paths = save_hf_model(model, tokenizer.hf_config, output, dtype=dtype)
    for name, data in tokenizer.files.items():
        (output / name).write_bytes(data)
    return paths


def main(argv: list[str] | None = None) -> int:
    """`python -m training.hf.policy CHECKPOINT OUT_DIR [--dtype bfloat16]`: export a training checkpoint of an
    imported model as a Hugging Face directory."""
    import argparse

    from training.checkpoint import CheckpointError
    from training.hf.loading import DTYPES

    parser = argparse.ArgumentParser(prog="python -m training.hf.policy", description=main.__doc__)
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the weights' own dtype")
    args = parser.parse_args(argv)
    if Path(args.out_dir).exists() and os.listdir(args.out_dir):
        parser.error(f"{args.out_dir} exists and is not empty")
    try:
        paths = export_checkpoint(args.checkpoint, args.out_dir, dtype=DTYPES.get(args.dtype))
    except (CheckpointError, FileNotFoundError, HFDirectoryError) as error:
        parser.error(str(error))
    print(f"wrote {args.out_dir}: {len(paths)} weight file(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
