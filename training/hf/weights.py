"""Hugging Face safetensors <-> MoETransformer parameters, one tensor at a time.

Loading builds the model with uninitialised storage and copies every checkpoint tensor into its
parameter as the shard is read (safetensors' safe_open maps the file; one tensor is materialised at a
time), so the peak memory is the model plus its largest tensor, not twice the model. Expert tensors
(`experts.<e>.gate_proj.weight`, [d_ff, d_model]) land transposed in slice e of the stacked
[n_experts, d_model, d_ff] parameters the grouped expert kernels take. Saving walks the same map back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from training.hf.deepseek import MODEL_TYPE, attention_tensors, is_extra_layer
from training.hf.families import Family
from training.model.config import ModelConfig
from training.model.transformer import MoETransformer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightsError(ValueError):
    """Checkpoint tensors that do not fit the model; the message names the tensor or the file."""


@dataclass(frozen=True)
class Target:
    """Where one Hugging Face tensor lives in MoETransformer."""

    parameter: str
    """Name in MoETransformer.state_dict()."""

    expert: int | None = None
    """Slice of a stacked expert parameter, or None for the whole parameter."""

    transpose: bool = False
    """The HF tensor is the transpose of the slice (expert projections are stored [out, in])."""


def tensor_map(config: ModelConfig, family: Family) -> dict[str, Target]:
    """Every tensor name of the family's checkpoint -> its Target (lm_head omitted when tied)."""
    names = {"model.embed_tokens.weight": Target("embed.weight"), "model.norm.weight": Target("norm.weight")}
    if not config.tie_embeddings:
        names["lm_head.weight"] = Target("output.weight")
    for layer in range(config.n_layers):
        hf, ours = f"model.layers.{layer}", f"layers.{layer}"
        names[f"{hf}.input_layernorm.weight"] = Target(f"{ours}.attention_norm.weight")
        names[f"{hf}.post_attention_layernorm.weight"] = Target(f"{ours}.ffn_norm.weight")
        if config.attention == "mla":
            names.update({hf_name: Target(our) for hf_name, our in attention_tensors(config, hf, ours).items()})
        else:
            names.update(_attention_map(config, hf, ours))
        if not config.is_moe_layer(layer):
            for hf_name, our_name in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
                names[f"{hf}.mlp.{hf_name}.weight"] = Target(f"{ours}.feed_forward.{our_name}.weight")
            continue
        names.update(_moe_map(config, family, f"{hf}.{family.moe_module}", f"{ours}.feed_forward"))
    return names


def _attention_map(config: ModelConfig, hf: str, ours: str) -> dict[str, Target]:
    """One layer's grouped-query attention tensors (projections, biases, qk-norms)."""
    names = {}
    for hf_name, our_name in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo")):
        names[f"{hf}.self_attn.{hf_name}.weight"] = Target(f"{ours}.attention.{our_name}.weight")
        if config.output_bias if hf_name == "o_proj" else config.qkv_bias:
            names[f"{hf}.self_attn.{hf_name}.bias"] = Target(f"{ours}.attention.{our_name}.bias")
    if config.qk_norm != "none":
        names[f"{hf}.self_attn.q_norm.weight"] = Target(f"{ours}.attention.q_norm.weight")
        names[f"{hf}.self_attn.k_norm.weight"] = Target(f"{ours}.attention.k_norm.weight")
    return names


def _moe_map(config: ModelConfig, family: Family, moe: str, ours: str) -> dict[str, Target]:
    """One MoE layer's router, score bias, routed experts (slices of the stacked parameters) and shared experts."""
    names = {f"{moe}.gate.weight": Target(f"{ours}.router.weight")}
    if config.router_score_bias:
        names[f"{moe}.gate.e_score_correction_bias"] = Target(f"{ours}.score_bias")
    for expert in range(config.n_experts):
        for hf_name, our_name in zip(family.expert_names, ("w_gate", "w_up", "w_down"), strict=True):
            names[f"{moe}.experts.{expert}.{hf_name}.weight"] = Target(f"{ours}.{our_name}", expert=expert, transpose=True)
    if config.n_shared_experts:
        for hf_name, our_name in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            names[f"{moe}.shared_experts.{hf_name}.weight"] = Target(f"{ours}.shared_experts.{our_name}.weight")
    return names


def _destination(parameters: dict[str, torch.Tensor], target: Target) -> torch.Tensor:
    tensor = parameters[target.parameter]
    if target.expert is not None:
        tensor = tensor[target.expert]
    return tensor.t() if target.transpose else tensor


def shard_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: the index's shards, or model.safetensors."""
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise WeightsError(f"{INDEX_FILE} is not a valid index (needs a 'weight_map'): {error}") from error
        files = sorted(set(weight_map.values()))
        unsafe = [name for name in files if Path(name).name != name or not name.endswith(".safetensors")]
        if unsafe:
            raise WeightsError(f"{INDEX_FILE} names shard(s) outside the directory or not .safetensors: {unsafe}.")
        missing = [name for name in files if not (directory / name).is_file()]
        if missing:
            raise WeightsError(f"{INDEX_FILE} names shard(s) that are missing: {', '.join(missing)}.")
        return [directory / name for name in files]
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    raise WeightsError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}.")


def load_weights(model: MoETransformer, directory: Path, family: Family) -> None:
    """Copy every tensor of the checkpoint in `directory` into `model`, shard by shard.

    Raises WeightsError naming a corrupt shard, an unexpected or missing tensor, or a tensor whose shape
    differs from the model's (with both shapes).
    """
    targets = tensor_map(model.config, family)
    parameters = dict(model.state_dict(keep_vars=True))
    seen: set[str] = set()
    with torch.no_grad():
        for path in shard_files(directory):
            try:
                with safe_open(str(path), framework="pt") as shard:
                    for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                        _load_tensor(shard, name, targets, parameters, family, model.config)
                        seen.add(name)
            except SafetensorError as error:
                raise WeightsError(f"{path.name} is not a readable safetensors file: {error}") from error
    missing = sorted(set(targets) - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightsError(f"The checkpoint lacks tensor(s) {', '.join(missing[:5])}{more}.")


def _load_tensor(
    shard, name: str, targets: dict[str, Target], parameters: dict, family: Family, config: ModelConfig
) -> None:
    target = targets.get(name)
    if target is None:
        if name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"):
            return  # a tied model's (identical) output matrix; older checkpoints' rotary buffers
        if family.model_type == MODEL_TYPE and is_extra_layer(name, config):
            return  # DeepSeek-V3's multi-token-prediction layers, which the model does not run
        raise WeightsError(f"The checkpoint holds tensor {name!r}, which a {family.model_type} model of this "
                           "config does not have.")
    destination = _destination(parameters, target)
    shape = tuple(shard.get_slice(name).get_shape())
    if shape != tuple(destination.shape):
        raise WeightsError(
            f"Tensor {name!r} has shape {shape} in the checkpoint but the model expects {tuple(destination.shape)}."
        )
    destination.copy_(shard.get_tensor(name))


def hf_tensors(model: MoETransformer, family: Family, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, contiguous tensor in `dtype`) of every tensor of the family's checkpoint, in map order."""
    parameters = dict(model.state_dict(keep_vars=True))
    for name, target in tensor_map(model.config, family).items():
        yield name, _destination(parameters, target).detach().to(dtype).contiguous()


def save_weights(
    model: MoETransformer, directory: Path, family: Family, *, dtype: torch.dtype, max_shard_bytes: int
) -> list[Path]:
    """Write the model as HF safetensors shards of at most ~max_shard_bytes (+ index when more than one).

    Each shard is written as soon as it is full, so at most one shard's tensors are held converted."""
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        path = directory / f"model-part-{len(written) + 1:05d}.safetensors.tmp"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append((path, list(shard)))
        shard.clear()

    for name, tensor in hf_tensors(model, family, dtype):
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        shard[name] = tensor
        size += nbytes
        total += nbytes
    flush()
    if len(written) == 1:
        return [written[0][0].rename(directory / SINGLE_FILE)]
    paths, weight_map = [], {}
    for index, (path, names) in enumerate(written, start=1):
        final = path.rename(directory / f"model-{index:05d}-of-{len(written):05d}.safetensors")
        paths.append(final)
        weight_map.update(dict.fromkeys(names, final.name))
    (directory / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return paths
