"""Contrastive fine-tuning of the code search encoder with in-batch negatives.

Each batch holds B (query, code) pairs from B different functions; the loss is cross-entropy of each
query against all B codes (sentence-transformers' ``MultipleNegativesRankingLoss``), so the other
functions in the batch are the negatives. Small by design: a few thousand pairs, one epoch, CPU.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import sysconfig
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sandboxes.semantic.config import default_encoder_path
from sandboxes.semantic.encoder import sentence_transformer_load
from training.embeddings.evaluation import HELD_OUT_STDLIB_MODULES, stdlib_directory
from training.embeddings.mining import PAIR_KINDS, TrainingPair, mine_pairs

logger = logging.getLogger(__name__)

FINETUNE_METADATA = "flowstate_finetune.json"


def default_source_roots() -> tuple[str, ...]:
    """Third-party packages installed next to the platform, and the interpreter's standard library.

    The standard library's held-out evaluation modules are left out by ``default_excluded_paths``.
    """
    site_packages = Path(sysconfig.get_paths()["purelib"])
    names = ("django", "celery", "kombu", "click", "rich", "requests", "jinja2", "rest_framework", "httpx")
    third_party = tuple(str(site_packages / name) for name in names if (site_packages / name).is_dir())
    return (*third_party, str(stdlib_directory()))


def default_excluded_paths() -> tuple[str, ...]:
    """Never mined: the retrieval benchmark's held-out stdlib modules, and packages installed inside
    the standard library's directory (pyenv and Debian put site-/dist-packages there)."""
    stdlib = stdlib_directory()
    held_out = tuple(str(stdlib / module) for module in HELD_OUT_STDLIB_MODULES)
    return (*held_out, str(stdlib / "site-packages"), str(stdlib / "dist-packages"))


@dataclass(frozen=True)
class EmbeddingFinetuneConfig:
    """One fine-tuning run of the search encoder."""

    output_dir: Path
    """Where the fine-tuned sentence-transformers model is saved; point SEMANTIC_ENCODER here to use it."""
    base_encoder: str = field(default_factory=default_encoder_path)
    """Model directory to start from (the bundled all-MiniLM-L6-v2 by default)."""
    source_roots: tuple[str, ...] = field(default_factory=default_source_roots)
    """Directories whose Python files are mined for pairs."""
    excluded_paths: tuple[str, ...] = field(default_factory=default_excluded_paths)
    """Files or directories under the roots that are never mined (the held-out evaluation code)."""
    max_pairs: int = 3000
    """Training pairs mined; one epoch over them is the whole run."""
    kind_fractions: tuple[tuple[str, float], ...] = (
        ("docstring", 0.55), ("comment", 0.15), ("name", 0.15), ("bug", 0.15),
    )
    """Share of each pair kind (docstring, comment, name, bug)."""
    batch_size: int = 32
    """Pairs per step; every other pair of the batch is a negative, so larger is harder."""
    epochs: int = 1
    """Passes over the pairs."""
    learning_rate: float = 3e-5
    """Peak AdamW learning rate."""
    warmup_fraction: float = 0.1
    """Fraction of steps with a linear warm-up before the linear decay."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    similarity_scale: float = 20.0
    """Inverse temperature of the cosine similarities in the contrastive loss."""
    max_seq_length: int = 128
    """Word pieces per text during training (shorter than at search time to keep CPU steps fast)."""
    seed: int = 0
    """Seeds mining order, batching and torch."""
    torch_threads: int = 2
    """CPU threads torch may use."""

    def __post_init__(self) -> None:
        if self.max_pairs < self.batch_size:
            raise ValueError(
                f"max_pairs={self.max_pairs} is below batch_size={self.batch_size}; mine more pairs or use smaller batches"
            )
        if self.batch_size < 2:
            raise ValueError("batch_size must be at least 2: in-batch negatives need another pair in the batch")
        if self.epochs < 1:
            raise ValueError("epochs must be at least 1")
        if not 0 < self.learning_rate < 1e-2:
            raise ValueError(f"learning_rate={self.learning_rate} is outside (0, 1e-2); 1e-5..1e-4 suits MiniLM")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError("warmup_fraction must lie in [0, 1)")
        if not 16 <= self.max_seq_length <= 512:
            raise ValueError("max_seq_length must lie in [16, 512]")
        kinds = dict(self.kind_fractions)
        if set(kinds) - set(PAIR_KINDS) or any(value < 0 for value in kinds.values()):
            raise ValueError(f"kind_fractions must map kinds from {PAIR_KINDS} to non-negative shares")
        if not math.isclose(sum(kinds.values()), 1.0, abs_tol=1e-6):
            raise ValueError(f"kind_fractions must sum to 1, got {sum(kinds.values()):.3f}")
        if not self.source_roots:
            raise ValueError("source_roots is empty: name at least one directory of Python code to mine")
        for root in self.source_roots:
            if not Path(root).is_dir():
                raise ValueError(f"source root {root} is not a directory")
        if not Path(self.base_encoder).is_dir():
            raise ValueError(f"base_encoder {self.base_encoder} is not a model directory")
        if Path(self.output_dir).resolve() == Path(self.base_encoder).resolve():
            raise ValueError("output_dir must differ from base_encoder so the base model is never overwritten")
        output = Path(self.output_dir)
        if output.exists() and any(output.iterdir()) and not (output / FINETUNE_METADATA).is_file():
            raise ValueError(
                f"output_dir {output} exists and is not a previous train_embeddings checkpoint; "
                "choose a new directory so nothing else is overwritten"
            )


@dataclass(frozen=True)
class FinetuneResult:
    output_dir: Path
    pairs: int
    pairs_by_kind: dict[str, int]
    steps: int
    first_loss: float
    last_loss: float
    seconds: float


def batches_without_duplicates(pairs: list[TrainingPair], *, batch_size: int, seed: int) -> list[list[TrainingPair]]:
    """Shuffled full batches in which no two pairs come from the same function.

    Two pairs of one function in a batch would make that function's code a false negative.
    """
    rng = random.Random(seed)
    buckets: dict[str, list[TrainingPair]] = {}
    for pair in pairs:
        buckets.setdefault(pair.group, []).append(pair)
    for bucket in buckets.values():
        rng.shuffle(bucket)
    tiebreak = {group: rng.random() for group in buckets}
    batches: list[list[TrainingPair]] = []
    while True:
        # Drawing from the fullest groups first keeps enough distinct groups alive to fill the last batches.
        available = sorted((g for g, bucket in buckets.items() if bucket), key=lambda g: (-len(buckets[g]), tiebreak[g]))
        if len(available) < batch_size:
            break
        batches.append([buckets[group].pop() for group in available[:batch_size]])
    rng.shuffle(batches)
    return batches


def _encoder_save(model, *, config: EmbeddingFinetuneConfig, result: FinetuneResult, losses: list[float]) -> None:
    """Write the encoder and its metadata (config, result, losses) to config.output_dir atomically: staged
    beside it, then renamed over it."""
    output_dir = Path(config.output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = output_dir.parent / f".{output_dir.name}.{uuid.uuid4().hex}.tmp"
    try:
        model.save(str(staging))
        metadata = {
            "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in asdict(config).items()},
            "result": {key: (str(value) if isinstance(value, Path) else value) for key, value in asdict(result).items()},
            "losses": losses,
        }
        (staging / FINETUNE_METADATA).write_text(json.dumps(metadata, indent=2))
        if output_dir.exists():
            shutil.rmtree(output_dir)
        os.replace(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def embeddings_finetune(
    *, config: EmbeddingFinetuneConfig, on_step: Callable[[int, int, float], None] | None = None
) -> FinetuneResult:
    """Mine pairs, train one run, and save the encoder atomically to ``config.output_dir``."""
    import torch

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from transformers import get_linear_schedule_with_warmup

    started = time.monotonic()
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.torch_threads)
    pairs = mine_pairs(
        roots=[Path(root) for root in config.source_roots],
        max_pairs=config.max_pairs,
        seed=config.seed,
        kind_fractions=dict(config.kind_fractions),
        excluded=[Path(path) for path in config.excluded_paths],
    )
    if len(pairs) < config.batch_size:
        raise ValueError(
            f"only {len(pairs)} pairs could be mined from {config.source_roots}; add source roots with more code"
        )
    pairs_by_kind = {kind: sum(1 for pair in pairs if pair.kind == kind) for kind in PAIR_KINDS}
    logger.info("mined %d pairs: %s", len(pairs), pairs_by_kind)

    model = sentence_transformer_load(config.base_encoder)
    model.max_seq_length = config.max_seq_length
    model.train()
    loss_fn = MultipleNegativesRankingLoss(model, scale=config.similarity_scale)
    schedule = [
        batches_without_duplicates(pairs, batch_size=config.batch_size, seed=config.seed + epoch)
        for epoch in range(config.epochs)
    ]
    total_steps = sum(len(epoch) for epoch in schedule)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=int(total_steps * config.warmup_fraction), num_training_steps=total_steps
    )
    losses_seen: list[float] = []
    step = 0
    for epoch_batches in schedule:
        for batch in epoch_batches:
            queries = model.preprocess([pair.query for pair in batch])
            codes = model.preprocess([pair.code for pair in batch])
            loss = loss_fn([queries, codes], labels=None)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"contrastive loss is {loss.item()} at step {step}; lower learning_rate")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            losses_seen.append(float(loss.item()))
            if on_step is not None:
                on_step(step, total_steps, losses_seen[-1])

    model.eval()
    # Searching uses the full sequence length even though training truncated harder.
    model.max_seq_length = 256
    window = max(1, len(losses_seen) // 10)
    result = FinetuneResult(
        output_dir=Path(config.output_dir),
        pairs=len(pairs),
        pairs_by_kind=pairs_by_kind,
        steps=step,
        first_loss=sum(losses_seen[:window]) / window,
        last_loss=sum(losses_seen[-window:]) / window,
        seconds=time.monotonic() - started,
    )
    _encoder_save(model, config=config, result=result, losses=losses_seen)
    return result
