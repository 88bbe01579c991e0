"""Distil the search encoder into fewer layers: a faster index build for a measured loss of recall.

The student starts as the teacher with only ``layers`` kept (teacher indices: the first and the last
layer matter most; dropping layers without training loses ~15 points of recall@5) and learns to
reproduce the teacher's unit vectors on what the index embeds: code chunks cut by the index's own
chunker, and the (query, code) pairs the fine-tuning mines from the same sources. Two terms:

- ``||student(x) - teacher(x)||^2`` for every text (queries, codes, chunks);
- ``similarity_weight`` x the squared difference of the in-batch query-code cosine matrices, so that the
  student ranks codes for a query as the teacher does.

Its embeddings stay frozen (they are the teacher's, and are not shipped again: see
``sandboxes.semantic.student``). The retrieval benchmark's held-out standard library modules are never
read. CPU only, minutes: ``manage.py distill_encoder``.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from sandboxes.semantic.chunking import chunk_file
from sandboxes.semantic.config import ChunkingConfig
from sandboxes.semantic.encoder import TorchTextEncoder, sentence_transformer_load
from sandboxes.semantic.student import (
    TEACHER_BUNDLED,
    is_student,
    keep_layers,
    student_layers,
    student_load,
    student_save,
    teacher_path,
)
from training.embeddings.finetune import (
    batches_without_duplicates,
    default_excluded_paths,
    default_source_roots,
)
from training.embeddings.mining import iter_python_files, mine_pairs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncoderDistillConfig:
    """One distillation run."""

    output_dir: Path = Path("var/embeddings/minilm-l3")
    """Where the student (``student.json`` + ``layers.safetensors``) is written; select it with
    ``SEMANTIC_ENCODER=<output_dir>``."""
    teacher: str = TEACHER_BUNDLED
    """The model distilled: ``bundled:all-MiniLM-L6-v2`` or a sentence-transformers directory."""
    layers: tuple[int, ...] = (0, 3, 5)
    """Teacher layers the student keeps, in order."""
    source_roots: tuple[str, ...] = field(default_factory=default_source_roots)
    """Directories whose Python files give the chunks and pairs."""
    excluded_paths: tuple[str, ...] = field(default_factory=default_excluded_paths)
    """Never read (the retrieval benchmark's held-out modules)."""
    pairs: int = 5000
    """(query, code) pairs mined; each step takes ``batch_size`` of them."""
    chunks: int = 5000
    """Index chunks sampled; each step takes ``batch_size`` of them beside the pairs."""
    epochs: int = 2
    """Passes over the pairs."""
    batch_size: int = 32
    """Pairs (and chunks) per step."""
    learning_rate: float = 1e-4
    """Peak AdamW learning rate (linear warm-up over 10 % of the steps, then linear decay)."""
    similarity_weight: float = 1.0
    """Weight of the in-batch similarity-matrix term."""
    contrastive_weight: float = 0.0
    """Weight of an in-batch contrastive term on the pairs (the fine-tuning's loss: each query against
    the batch's codes, scale 20); 0 distils only."""
    init: str | None = None
    """A student directory to continue from (same layers), instead of the teacher's layers."""
    max_seq_length: int = 128
    """Word pieces per text for teacher and student alike: the index's default length, at which the student
    will be used."""
    seed: int = 0
    """Seeds sampling, batching and torch."""
    torch_threads: int = 2
    """CPU threads torch may use."""

    def __post_init__(self) -> None:
        if self.pairs < self.batch_size or self.chunks < self.batch_size:
            raise ValueError(f"pairs and chunks must each be at least batch_size={self.batch_size}")
        if self.batch_size < 2 or self.epochs < 1:
            raise ValueError("batch_size must be >= 2 and epochs >= 1")
        if not 0 < self.learning_rate < 1e-2:
            raise ValueError(f"learning_rate={self.learning_rate} is outside (0, 1e-2)")
        for name in ("similarity_weight", "contrastive_weight"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and 0 <= value <= 100):
                raise ValueError(f"{name} must be a finite number in [0, 100]")
        if self.init is not None and not is_student(self.init):
            raise ValueError(f"init {self.init} is not a student directory (no student.json)")
        if not 16 <= self.max_seq_length <= 512:
            raise ValueError("max_seq_length must lie in [16, 512]")
        if not self.layers:
            raise ValueError("layers must name at least one teacher layer")
        if not Path(teacher_path(self.teacher)).is_dir():
            raise ValueError(f"teacher {self.teacher} is not a model directory")
        for root in self.source_roots:
            if not Path(root).is_dir():
                raise ValueError(f"source root {root} is not a directory")


@dataclass(frozen=True)
class DistillResult:
    output_dir: Path
    texts: int
    steps: int
    first_loss: float
    last_loss: float
    mean_cosine_to_teacher: float
    """Over up to 2,000 of the training texts after training (1.0 would be a copy)."""
    seconds: float


def sample_chunks(config: EncoderDistillConfig) -> list[str]:
    """``config.chunks`` index chunks of the source roots, rendered as the index embeds them."""
    rng = random.Random(config.seed)
    files = list(iter_python_files([Path(root) for root in config.source_roots],
                                   excluded=[Path(path) for path in config.excluded_paths]))
    rng.shuffle(files)
    texts: list[str] = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        chunks = chunk_file(path=f"{path.parent.name}/{path.name}", source=source, config=ChunkingConfig())
        texts.extend(chunk.embedding_text() for chunk in rng.sample(chunks, min(4, len(chunks))))
        if len(texts) >= config.chunks:
            break
    return texts[:config.chunks]


def _step_loss(torch, student, batch: list[str], targets, *, pairs: int, config: EncoderDistillConfig):
    """Vector, similarity-matrix and contrastive loss of one step; the batch is queries, codes, then chunks."""
    vectors = student(student.preprocess(batch))["sentence_embedding"]
    vector_loss = ((vectors - targets) ** 2).sum(dim=1).mean()
    queries, codes = vectors[:pairs], vectors[pairs:2 * pairs]
    similarity = queries @ codes.T
    teacher_similarity = targets[:pairs] @ targets[pairs:2 * pairs].T
    loss = vector_loss + config.similarity_weight * ((similarity - teacher_similarity) ** 2).mean()
    if config.contrastive_weight:
        labels = torch.arange(pairs)
        loss = loss + config.contrastive_weight * torch.nn.functional.cross_entropy(similarity * 20.0, labels)
    return loss


def embeddings_distill(
    *, config: EncoderDistillConfig, on_step: Callable[[int, int, float], None] | None = None
) -> DistillResult:
    """Mine texts, compute the teacher's vectors once, train the student, save it atomically."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    started = time.monotonic()
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.torch_threads)
    pairs = mine_pairs(roots=[Path(root) for root in config.source_roots], max_pairs=config.pairs, seed=config.seed,
                       excluded=[Path(path) for path in config.excluded_paths])
    chunks = sample_chunks(config)
    if len(pairs) < config.batch_size or len(chunks) < config.batch_size:
        raise ValueError(f"only {len(pairs)} pairs and {len(chunks)} chunks found in {config.source_roots}")
    texts = [pair.query for pair in pairs] + [pair.code for pair in pairs] + chunks
    teacher = sentence_transformer_load(teacher_path(config.teacher))
    teacher.max_seq_length = config.max_seq_length
    teacher.eval()
    targets = torch.from_numpy(TorchTextEncoder(teacher).encode(texts, batch_size=64))
    logger.info("teacher vectors of %d texts after %.0fs", len(texts), time.monotonic() - started)
    layers = student_layers(config.init) if config.init else list(config.layers)
    student = student_load(config.init) if config.init else keep_layers(teacher, layers)
    student.max_seq_length = config.max_seq_length
    for name, parameter in student.named_parameters():
        parameter.requires_grad = ".embeddings." not in f".{name}"
    student.train()
    schedule = [batches_without_duplicates(pairs, batch_size=config.batch_size, seed=config.seed + epoch)
                for epoch in range(config.epochs)]
    steps_per_epoch = min(min(len(batches) for batches in schedule), len(chunks) // config.batch_size)
    total = steps_per_epoch * config.epochs
    trainable = [parameter for parameter in student.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=max(1, total // 10),
                                                num_training_steps=total)
    rng = np.random.default_rng(config.seed)
    losses: list[float] = []
    n, b = len(pairs), config.batch_size
    position = {id(pair): row for row, pair in enumerate(pairs)}
    for batches in schedule:
        pair_order = np.array([position[id(pair)] for batch in batches for pair in batch], dtype=np.int64)
        chunk_order = rng.permutation(len(chunks))
        for step in range(steps_per_epoch):
            rows = pair_order[step * b:(step + 1) * b]
            chunk_rows = chunk_order[step * b:(step + 1) * b]
            index = np.concatenate([rows, n + rows, 2 * n + chunk_rows])
            loss = _step_loss(torch, student, [texts[i] for i in index], targets[index], pairs=b, config=config)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"distillation loss is {loss.item()} at step {len(losses)}; lower learning_rate")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(float(loss.item()))
            if on_step is not None:
                on_step(len(losses), total, losses[-1])
    student.eval()
    sample = rng.permutation(len(texts))[:2000]
    after = TorchTextEncoder(student).encode([texts[i] for i in sample], batch_size=64)
    cosine = float(np.mean(np.sum(after * targets.numpy()[sample], axis=1)))
    window = max(1, len(losses) // 10)
    result = DistillResult(output_dir=Path(config.output_dir), texts=len(texts), steps=len(losses),
                           first_loss=float(np.mean(losses[:window])), last_loss=float(np.mean(losses[-window:])),
                           mean_cosine_to_teacher=cosine, seconds=time.monotonic() - started)
    _save(student=student, config=replace(config, layers=tuple(layers)), result=result)
    return result


def _save(*, student, config: EncoderDistillConfig, result: DistillResult) -> None:
    """Stage the student beside ``output_dir``, then swap it in."""
    output = Path(config.output_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.{uuid.uuid4().hex}.tmp"
    made_by = {"command": "manage.py distill_encoder",
               "config": {key: (str(value) if isinstance(value, Path) else value)
                          for key, value in asdict(config).items() if key not in ("source_roots", "excluded_paths")},
               "result": {key: (str(value) if isinstance(value, Path) else value) for key, value in asdict(result).items()}}
    try:
        student_save(model=student, destination=staging, teacher=config.teacher, layers=list(config.layers),
                     made_by=made_by)
        if output.exists():
            shutil.rmtree(output)
        os.replace(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
