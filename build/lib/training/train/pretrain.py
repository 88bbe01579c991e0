"""Continued pretraining: next-token loss on code that is available offline, plus router aux losses.

Launch:

    .venv/bin/python manage.py pretrain --run-dir var/runs/pretrain --model tiny --steps 200
    .venv/bin/python manage.py pretrain --run-dir var/runs/pretrain --init-checkpoint var/ckpt/base \\
        --extra-dir /path/to/registered/repo
    torchrun --nproc-per-node 2 manage.py pretrain --run-dir var/runs/pretrain-dp [--expert-parallel]

Re-running the same command after a crash resumes from the newest checkpoint in --run-dir with
the exact model, optimizer, scheduler, RNG and data position.

The corpus is the CPython standard library of the running interpreter (training.corpus) plus any
repository directories given with extra_dirs. Documents are tokenized, joined with <|endoftext|>
and cut into fixed windows; each step draws windows in a seeded per-epoch order.

How this differs from a production continued-pretraining recipe (e.g. DeepSeek-Coder, OLMoE):
a tiny offline corpus instead of trillions of deduplicated tokens; no data mixing with general
text to prevent forgetting; no document masking across window boundaries; fixed context length
(no long-context stage); AdamW with cosine decay rather than WSD; aux losses as in Switch/ST-MoE
(load balancing + router z-loss) rather than aux-loss-free bias balancing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from training.checkpoint import load_checkpoint
from training.corpus import CorpusConfig, iter_documents
from training.model.config import ModelConfig
from training.tokenizer import SPECIAL_TOKENS, BPETokenizer, default_tokenizer, load_tokenizer
from training.train.data import InductionSequences, PackedTokenWindows
from training.train.distributed import DistributedContext
from training.train.loop import LoopConfig, TrainConfigError, TrainResult, train_supervised


@dataclass
class PretrainConfig:
    """A continued-pretraining run."""

    run_dir: str
    """Directory for checkpoints/ and metrics.jsonl; re-running with the same run_dir resumes."""

    model: str = "tiny"
    """Named ModelConfig preset for a fresh model (ignored when init_checkpoint is given)."""

    init_checkpoint: str | None = None
    """Checkpoint directory to continue from (weights, config and tokenizer); None starts from scratch."""

    tokenizer: str | None = None
    """tokenizer.json (or a directory holding one) for a fresh model; None trains the default stdlib BPE."""

    extra_dirs: tuple[str, ...] = ()
    """Registered repository paths added to the stdlib corpus."""

    include_stdlib: bool = True
    """Read this interpreter's standard library sources."""

    data: str = "code"
    """"code": the corpus above; "induction": synthetic copy windows (training.train.data.InductionSequences),
    the warm-up that gives a fresh model induction heads before SFT on agent trajectories."""

    corpus_max_bytes: int | None = 2_000_000
    """Cap on corpus text (None reads everything)."""

    seq_len: int = 256
    """Tokens per training window."""

    loop: LoopConfig = field(default_factory=LoopConfig)
    """Steps, batch sizes, optimizer, checkpointing."""

    def __post_init__(self) -> None:
        if isinstance(self.loop, dict):
            self.loop = LoopConfig(**self.loop)
        self.extra_dirs = tuple(self.extra_dirs)
        if self.init_checkpoint is not None and self.tokenizer is not None:
            raise TrainConfigError(
                "init_checkpoint brings its own tokenizer; drop tokenizer (or drop init_checkpoint to "
                "start a fresh model with that tokenizer)."
            )
        if self.seq_len < 8:
            raise TrainConfigError(f"seq_len={self.seq_len} is too short to learn from; use at least 8.")
        if self.data not in ("code", "induction"):
            raise TrainConfigError(f"data={self.data!r}: choose 'code' (the corpus) or 'induction' (synthetic copies).")
        if self.data == "induction" and self.seq_len < 64:
            raise TrainConfigError(f"seq_len={self.seq_len} is too short for induction copy blocks; use at least 64.")


def pretrain(
    config: PretrainConfig,
    *,
    context: DistributedContext | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Run (or resume) continued pretraining; returns the final checkpoint and per-step metrics."""
    # 1. Model config, tokenizer and (for continued pretraining) the starting weights.
    initial_weights = None
    if config.init_checkpoint is not None:
        source_model, tokenizer, _ = load_checkpoint(config.init_checkpoint)
        model_config = source_model.config
        source_state = source_model.state_dict()

        def initial_weights(model) -> None:
            model.load_state_dict(source_state)
    else:
        model_config = ModelConfig.named(config.model)
        tokenizer = _fresh_tokenizer(config, model_config)
    if config.seq_len > model_config.max_seq_len:
        raise TrainConfigError(
            f"seq_len={config.seq_len} exceeds the model's max_seq_len={model_config.max_seq_len}; lower seq_len."
        )

    # 2. Data: tokenized corpus cut into windows (or synthetic copy windows), indexed by a global sample counter.
    if config.data == "induction":
        data = InductionSequences(
            vocab_size=tokenizer.vocab_size,
            first_token_id=1 + max(tokenizer.token_id(token) for token in SPECIAL_TOKENS),  # no specials
            seq_len=config.seq_len,
            seed=config.loop.seed,
        )
    else:
        data = _corpus_windows(config, tokenizer)

    # 3. Train (resuming when run_dir already holds a checkpoint).
    return train_supervised(
        model_config=model_config,
        data=data,
        config=config.loop,
        run_dir=config.run_dir,
        run_config={"stage": "pretrain", **asdict(config)},
        context=context,
        initial_weights=initial_weights,
        tokenizer=tokenizer,
        on_step=on_step,
    )


def _corpus_windows(config: PretrainConfig, tokenizer: BPETokenizer) -> PackedTokenWindows:
    corpus = CorpusConfig(
        extra_dirs=config.extra_dirs, include_stdlib=config.include_stdlib, max_bytes=config.corpus_max_bytes
    )
    texts = [document.text for document in iter_documents(corpus)]
    return PackedTokenWindows(
        documents=tokenizer.encode_batch(texts),
        separator_id=tokenizer.end_of_text_id,
        seq_len=config.seq_len,
        seed=config.loop.seed,
    )


def _fresh_tokenizer(config: PretrainConfig, model_config: ModelConfig) -> BPETokenizer:
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else default_tokenizer(model_config.vocab_size)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise TrainConfigError(
            f"The tokenizer has {tokenizer.vocab_size} tokens but model {config.model!r} embeds "
            f"{model_config.vocab_size}; use a larger model preset or a smaller tokenizer."
        )
    return tokenizer
