"""Import of a >= 1 GB sharded Hugging Face checkpoint: wall time and peak memory (RSS) against its bytes.

A random bf16 Qwen3-MoE checkpoint (~1.1 GB, 5 layers of 32 experts) is written locally shard by shard
(never whole in memory), then a fresh child process runs what `manage.py import_model` runs on the
files (inspect the directory, load every tensor into Flowstate's model, checksum, copy) and reports its
peak RSS (ru_maxrss) and its current RSS before loading (Python + torch + imports). The target is peak / checkpoint
bytes <= 1.3.

    .venv/bin/python benchmarks/bench_import.py [--layers 5] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.hf.families import FAMILIES, config_from_hf
from training.hf.weights import INDEX_FILE, tensor_map
from training.model.transformer import MoETransformer

SHARD_BYTES = 200 * 1024**2
CHILD = r"""
import json, resource, sys, time, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import torch
from training.hf.directory import inspect_directory, kept_files, checksum, copy_files
from training.hf.loading import load_hf_model
before = int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) * 1024
source = Path(sys.argv[1])
start = time.perf_counter()
report = inspect_directory(source)
model, _, _ = load_hf_model(source)
loaded = time.perf_counter() - start
files = kept_files(source, report)
digest = checksum(files)
with tempfile.TemporaryDirectory() as out:
    copy_files(files, Path(out) / "copy")
total = time.perf_counter() - start
print(json.dumps({"before": before, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "load_s": loaded, "import_s": total, "params": sum(p.numel() for p in model.parameters())}))
"""


def hf_config(layers: int) -> dict:
    return {"model_type": "qwen3_moe", "vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": layers,
            "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 2048,
            "moe_intermediate_size": 1024, "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": True,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "torch_dtype": "bfloat16",
            "tie_word_embeddings": False, "hidden_act": "silu"}


def write_checkpoint(directory: Path, layers: int) -> int:
    """Random bf16 shards (+ index, config, tokenizer files); returns the weight bytes."""
    config_dict = hf_config(layers)
    config = config_from_hf(config_dict)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in MoETransformer(config).state_dict().items()}
    shard, size, total, index, weight_map = {}, 0, 0, 0, {}

    def flush():
        nonlocal shard, size, index
        index += 1
        name = f"model-{index:05d}.safetensors"
        save_file(shard, str(directory / name))
        weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for name, target in tensor_map(config, FAMILIES["qwen3_moe"]).items():
        shape = shapes[target.parameter][1:] if target.expert is not None else shapes[target.parameter]
        shape = tuple(reversed(shape)) if target.transpose else shape
        tensor = (torch.randn(shape) * 0.02).to(torch.bfloat16)
        shard[name] = tensor
        size += tensor.numel() * 2
        total += tensor.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config_dict))
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0, "<|im_end|>": 1}, unk_token="<unk>")).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"}))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        directory = Path(root) / "ckpt"
        directory.mkdir()
        start = time.perf_counter()
        weight_bytes = write_checkpoint(directory, args.layers)
        print(f"wrote {weight_bytes / 1e9:.2f} GB in {len(list(directory.glob('*.safetensors')))} shards "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
        repo = str(Path(__file__).resolve().parent.parent)
        out = subprocess.run([sys.executable, "-c", CHILD, str(directory), repo], capture_output=True, text=True,
                             check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
    peak, before = result["peak"], result["before"]
    print(f"params {result['params'] / 1e6:.0f}M, load {result['load_s']:.1f} s, import (check + load + checksum "
          f"+ copy) {result['import_s']:.1f} s")
    print(f"peak RSS {peak / 1e9:.2f} GB = {peak / weight_bytes:.2f}x the checkpoint; above the pre-load RSS "
          f"({before / 1e9:.2f} GB): {(peak - before) / 1e9:.2f} GB = {(peak - before) / weight_bytes:.2f}x")


if __name__ == "__main__":
    main()
