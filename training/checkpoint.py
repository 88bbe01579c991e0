"""Checkpoints: model.safetensors + config.json (model config and metadata) + tokenizer.json.

A checkpoint of an imported Hugging Face model carries that model's own tokenizer files, chat template
and config under hf/ instead of tokenizer.json (training.hf.policy), and load_checkpoint also reads a
Hugging Face directory itself (a registered model) as the policy to start from.

Files are written under temporary names and renamed into place, so a crash mid-save leaves the previous
checkpoint readable; config.json is renamed last and marks the checkpoint complete.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_model, save_model

from training.model.config import ModelConfig
from training.model.transformer import MoETransformer
from training.tokenizer import TOKENIZER_FILE, BPETokenizer, default_tokenizer, load_tokenizer

if TYPE_CHECKING:
    from training.hf.policy import HFTokenizer

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint directory that is incomplete or inconsistent; the message says what is wrong."""


def save_checkpoint(
    directory: str | Path,
    model: MoETransformer,
    tokenizer: BPETokenizer | HFTokenizer,
    extra_meta: dict[str, Any] | None = None,
) -> Path:
    """Write weights, tokenizer and config (+ JSON-serialisable extra_meta) into `directory`; an imported
    model's tokenizer (training.hf.policy.HFTokenizer) is written with its template and config under hf/."""
    directory = Path(directory)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(
            f"Tokenizer has {tokenizer.vocab_size} tokens but the model embeds only "
            f"{model.config.vocab_size}; build the model with vocab_size >= {tokenizer.vocab_size}."
        )
    meta = dict(extra_meta or {})
    hf_tokenizer = _is_hf_tokenizer(tokenizer)
    if hf_tokenizer:
        from training.hf.policy import TOKENIZER_KIND

        meta["tokenizer"] = TOKENIZER_KIND
    try:
        json.dumps(meta)
    except TypeError as error:
        raise CheckpointError(f"extra_meta must be JSON-serialisable: {error}") from error
    directory.mkdir(parents=True, exist_ok=True)
    weights_tmp = directory / (WEIGHTS_FILE + ".tmp")
    save_model(model, str(weights_tmp), metadata={"format_version": str(FORMAT_VERSION)})
    tokenizer_tmp = directory / (TOKENIZER_FILE + ".tmp")
    if hf_tokenizer:
        from training.hf.policy import HF_SUBDIR

        tokenizer.save(directory / HF_SUBDIR)  # complete before config.json marks the checkpoint complete
    else:
        tokenizer_tmp.write_text(tokenizer.to_json())
    config_tmp = directory / (CONFIG_FILE + ".tmp")
    config_tmp.write_text(
        json.dumps(
            {"format_version": FORMAT_VERSION, "model": model.config.to_dict(), "meta": meta},
            indent=2,
            sort_keys=True,
        )
    )
    os.replace(weights_tmp, directory / WEIGHTS_FILE)
    if not hf_tokenizer:
        os.replace(tokenizer_tmp, directory / TOKENIZER_FILE)
    os.replace(config_tmp, directory / CONFIG_FILE)
    return directory


def read_checkpoint_config(directory: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """The model config and metadata of a checkpoint, without loading weights."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint: {CONFIG_FILE} is missing.")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from error
    if data.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format_version {data.get('format_version')!r}; this code reads version {FORMAT_VERSION}."
        )
    return ModelConfig.from_dict(data["model"]), data.get("meta", {})


def _is_hf_tokenizer(tokenizer: Any) -> bool:
    from training.hf.policy import is_hf_tokenizer

    return is_hf_tokenizer(tokenizer)


def load_checkpoint(
    directory: str | Path, *, device: str | torch.device = "cpu", precision: str | None = None
) -> tuple[MoETransformer, BPETokenizer | HFTokenizer, dict[str, Any]]:
    """Load (model in eval mode, tokenizer, meta) from a directory written by save_checkpoint, or from a
    Hugging Face model directory (weights in fp32, its tokenizer and chat template: training.hf.policy).

    precision: numerics of the expert matmuls ("fp32", "bf16", "mxfp8"), None: the checkpoint's own.
    """
    from training.hf.policy import HF_SUBDIR, TOKENIZER_KIND, HFTokenizer, is_hf_directory, load_hf_policy

    directory = Path(directory)
    if is_hf_directory(directory):
        model, tokenizer, meta = load_hf_policy(directory, device=device, precision=precision)
        return model.eval(), tokenizer, meta
    config, meta = read_checkpoint_config(directory)
    if precision is not None:
        config = replace(config, precision=precision)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{directory} has {CONFIG_FILE} but no {WEIGHTS_FILE}.")
    if meta.get("tokenizer") == TOKENIZER_KIND:
        tokenizer = HFTokenizer.from_directory(directory / HF_SUBDIR)
    else:
        tokenizer = load_tokenizer(directory)
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{directory}: tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
            f"vocab_size={config.vocab_size}; the tokenizer does not belong to these weights."
        )
    with torch.device("meta"):
        model = MoETransformer(config)
    model = model.materialize(device)
    try:
        load_model(model, str(weights), strict=True, device=str(device))
    except (RuntimeError, OSError) as error:
        raise CheckpointError(f"{weights} does not match config.json: {error}") from error
    return model.eval(), tokenizer, meta


def _weighted_checkpoint(
    *, sources: list[str | Path], weights: list[float], output: str | Path, meta: dict[str, Any], fix: str
) -> Path:
    """Write sum(weight * weights of source) (float64 sums) to `output`; `fix` ends the mismatch errors."""
    model, tokenizer, _ = load_checkpoint(sources[0])
    total = {name: weights[0] * tensor.to(torch.float64) for name, tensor in model.state_dict().items()}
    for source, weight in zip(sources[1:], weights[1:], strict=True):
        other, other_tokenizer, _ = load_checkpoint(source)
        if other.config != model.config:
            raise CheckpointError(f"{source} has another model config than {sources[0]}; {fix}")
        if other_tokenizer.to_json() != tokenizer.to_json():
            raise CheckpointError(f"{source} has another tokenizer than {sources[0]}; {fix}")
        for name, tensor in other.state_dict().items():
            total[name] += weight * tensor.to(torch.float64)
    dtypes = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    model.load_state_dict({name: value.to(dtypes[name]) for name, value in total.items()})
    return save_checkpoint(output, model, tokenizer, meta)


def average_checkpoints(*, sources: list[str | Path], output: str | Path) -> Path:
    """Write the uniform average of the weights of `sources` (checkpoints of one model and tokenizer) to
    `output`: averaging the last checkpoints of a run smooths the noise of its final updates."""
    if len(sources) < 2:
        raise CheckpointError(f"averaging needs at least two checkpoints, got {len(sources)}")
    return _weighted_checkpoint(
        sources=sources, weights=[1 / len(sources)] * len(sources), output=output,
        meta={"source": "average", "averaged": [str(path) for path in sources]}, fix="average one run's checkpoints",
    )


def interpolate_checkpoints(*, start: str | Path, end: str | Path, alpha: float, output: str | Path) -> Path:
    """Write `start + alpha * (end - start)` to `output`, with the tokenizer both share.

    With `start` an RL run's initial checkpoint and `end` its final one, `alpha` < 1 moves the trained
    weights back towards the initial policy (WiSE-FT / WARP's interpolation towards the initialisation,
    which can keep what the run learned while giving back some of the breadth it lost) and `alpha` > 1
    goes further along the run's direction (ExPO-style extrapolation). Choose `alpha` on a validation
    suite, never on the test it is reported on.
    """
    if not math.isfinite(alpha) or alpha <= 0:
        raise CheckpointError(f"alpha must be a positive number (1 = `end` itself), got {alpha}")
    return _weighted_checkpoint(
        sources=[start, end], weights=[1 - alpha, alpha], output=output,
        meta={"source": "interpolation", "start": str(start), "end": str(end), "alpha": alpha},
        fix="interpolate a run's start and end",
    )


def create_random_checkpoint(
    directory: str | Path, size: str = "tiny", seed: int = 0, **config_overrides: Any
) -> Path:
    """A randomly initialised checkpoint with a tokenizer trained on the capped stdlib corpus (seconds)."""
    config = ModelConfig.named(size, **config_overrides)
    tokenizer = default_tokenizer(config.vocab_size)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = MoETransformer(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return save_checkpoint(directory, model, tokenizer, {"source": "random", "size": size, "seed": seed})


def main(argv: list[str] | None = None) -> int:
    """`python -m training.checkpoint OUT_DIR --size tiny`: write a random-weight checkpoint to serve;
    `python -m training.checkpoint OUT_DIR --interpolate START END --alpha A`: interpolate two checkpoints."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m training.checkpoint",
        description="Create a randomly initialised checkpoint (tokenizer trained on the stdlib corpus), e.g. "
        "for FLOWSTATE_MODEL_CHECKPOINT before any training has run; or, with --interpolate, mix two "
        "checkpoints of one model (an RL run's start and end).",
    )
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    parser.add_argument("--size", default="tiny", help="ModelConfig.named preset (tiny, small, base, ...)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--interpolate",
        nargs=2,
        metavar=("START", "END"),
        help="instead of random weights, write START + ALPHA * (END - START) of two checkpoints of one model",
    )
    parser.add_argument("--alpha", type=float, default=None, help="the weight of END with --interpolate")
    args = parser.parse_args(argv)
    if (args.interpolate is None) != (args.alpha is None):
        parser.error("--interpolate START END and --alpha go together")
    if args.interpolate:
        start, end = args.interpolate
        try:
            directory = interpolate_checkpoints(start=start, end=end, alpha=args.alpha, output=args.out_dir)
        except (CheckpointError, FileNotFoundError) as error:
            parser.error(str(error))
        print(f"wrote {directory}: {start} + {args.alpha} * ({end} - {start})")
        return 0
    directory = create_random_checkpoint(args.out_dir, size=args.size, seed=args.seed)
    config, _ = read_checkpoint_config(directory)
    counts = config.parameter_counts()
    print(
        f"wrote {directory}: {args.size}, {counts['total'] / 1e6:.2f}M parameters "
        f"({counts['active'] / 1e6:.2f}M active), vocab {config.vocab_size}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
