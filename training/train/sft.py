"""Supervised fine-tuning on agent trajectories, loss only on the assistant's tokens.

Launch:

    .venv/bin/python manage.py sft --run-dir var/runs/sft --init-checkpoint var/runs/pretrain/checkpoints/step-00000200 \\
        --expert-tasks 64 --database-limit 500 --jsonl trajectories.jsonl

Trajectories are OpenAI message lists from three sources: (a) recorded product tasks and RL
rollouts in the database (webapp.agents.selectors.trajectories_for_sft: succeeded runs, positive
reward), (b) JSONL files (one message list, or {"messages": [...]}, per line), and (c) the scripted
expert of training.train.scripted_expert, run through the real agent loop in real sandboxes on toy
tasks. Each trajectory is rendered with the same chat template and tool schemas the served model
sees (training.chat_format + sandboxes.tools.openai_tool_schemas); tokens of assistant completions
(text, tool-call block, end-of-turn) are trained, everything else (system, user, tool output) is
context only. An init_checkpoint of an imported model (a Hugging Face directory or a checkpoint of one)
renders with that model's own chat template instead (training.hf.sft).

Exact resume (same run_dir) assumes the same trajectories: the expert and JSONL sources are
deterministic, but database rows recorded between the two invocations change the data set.

How this differs from common agent-SFT recipes (e.g. SWE-smith, SWE-Gym): trajectories come from
a scripted solver rather than a strong teacher model, no rejection sampling over many attempts, no
packing of several conversations per sequence, and sequences longer than max_seq_len are truncated
(their later turns are lost) rather than split at summary boundaries.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sandboxes.tools import openai_tool_schemas
from training.chat_format import render_assistant_completion, render_messages
from training.checkpoint import load_checkpoint
from training.model.config import ModelConfig
from training.tokenizer import BPETokenizer, default_tokenizer
from training.train.data import MaskedExamples, TokenizedExample
from training.train.distributed import DistributedContext
from training.train.loop import LoopConfig, TrainConfigError, TrainResult, train_supervised


@dataclass
class SFTConfig:
    """A supervised fine-tuning run on agent trajectories."""

    run_dir: str
    """Directory for checkpoints/ and metrics.jsonl; re-running with the same run_dir resumes."""

    init_checkpoint: str | None = None
    """Checkpoint to fine-tune (usually the pretraining result); None starts a fresh `model`."""

    model: str = "tiny"
    """Named preset for a fresh model (only without init_checkpoint)."""

    database_limit: int = 0
    """Newest recorded trajectories to read from the database (0 skips the database)."""

    jsonl_files: tuple[str, ...] = ()
    """JSONL files of trajectories: one message list (or {"messages": [...]}) per line."""

    expert_tasks: int = 0
    """Toy training tasks to solve with the scripted expert (0 skips the expert)."""

    expert_seed_start: int = 0
    """First toy-task index of the train split used for expert trajectories."""

    sandbox_backend: str | None = None
    """Backend the expert runs in (None: the configured default)."""

    max_seq_len: int = 4096
    """Longest training sequence in tokens (longer trajectories are truncated); a fresh model is built
    with this max_seq_len and a checkpoint with a shorter one is extended to it. The system prompt with all tool schemas alone is ~1.3k tokens."""

    context_loss: bool = False
    """Also train next-token prediction on the user and tool messages (never on the system prompt with
    the tool block, which is the same in every trajectory). A bug report names its package twice and
    tool outputs repeat paths and source lines, so this gives a from-scratch model many examples of
    copying from its context per trajectory, where the assistant turns alone hold a handful."""

    loop: LoopConfig = field(default_factory=lambda: LoopConfig(steps=100, batch_size=4, micro_batch_size=2))
    """Steps, batch sizes, optimizer, checkpointing."""

    def __post_init__(self) -> None:
        if isinstance(self.loop, dict):
            self.loop = LoopConfig(**self.loop)
        self.jsonl_files = tuple(self.jsonl_files)
        if self.database_limit < 0 or self.expert_tasks < 0:
            raise TrainConfigError("database_limit and expert_tasks must be >= 0.")
        if not (self.database_limit or self.jsonl_files or self.expert_tasks):
            raise TrainConfigError(
                "SFT has no data: set database_limit > 0, give jsonl_files, or set expert_tasks > 0."
            )
        for path in self.jsonl_files:
            if not Path(path).is_file():
                raise TrainConfigError(f"Trajectory file {path!r} does not exist.")


def tokenize_trajectory(
    *,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]],
    tokenizer: BPETokenizer,
    context_loss: bool = False,
) -> TokenizedExample:
    """Render with the chat template; assistant completions are trainable, the rest is context
    (with `context_loss`, user and tool messages are trainable too; the system turn never is). An
    assistant message with `"train": false` is never trainable: a deliberate mistake in a recovery
    trajectory is shown to the model as context, not taught.

    Each piece is tokenized separately at its template boundary, which is exactly how the model
    meets it at inference: the prompt (ending in the generation prompt) is encoded, then the
    completion is generated token by token.
    """
    token_ids: list[int] = []
    trainable: list[bool] = []
    rendered = ""

    def append(text: str, train: bool) -> None:
        ids = tokenizer.encode(text) if text else []
        token_ids.extend(ids)
        trainable.extend([train] * len(ids))

    def append_context(text: str) -> None:
        if not rendered and context_loss:
            has_system = bool(messages) and messages[0].get("role") == "system"
            system = render_messages(messages[:1] if has_system else [], tools, add_generation_prompt=False)
            if text.startswith(system):
                append(system, False)
                text = text[len(system) :]
        append(text, context_loss)

    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = render_messages(messages[:index], tools, add_generation_prompt=True)
        if not prompt.startswith(rendered):
            raise ValueError(f"Message {index}: the chat template is not prefix-stable for this trajectory.")
        completion = render_assistant_completion(message)
        append_context(prompt[len(rendered) :])
        append(completion, message.get("train", True) is not False)
        rendered = prompt + completion
    full = render_messages(messages, tools, add_generation_prompt=False)
    if not full.startswith(rendered):
        raise ValueError("The rendered trajectory does not extend its assistant prefixes; check the messages.")
    append(full[len(rendered) :], False)
    return TokenizedExample(token_ids=token_ids, trainable=trainable)


def _tokenize(*, messages, tools, tokenizer, context_loss: bool) -> TokenizedExample:
    """An imported model's conversations go through its own chat template (training.hf.sft)."""
    from training.hf.policy import is_hf_tokenizer

    if is_hf_tokenizer(tokenizer):
        from training.hf.sft import tokenize_hf_trajectory

        return tokenize_hf_trajectory(messages=messages, tools=tools, tokenizer=tokenizer, context_loss=context_loss)
    return tokenize_trajectory(messages=messages, tools=tools, tokenizer=tokenizer, context_loss=context_loss)


def load_jsonl_trajectories(path: str | Path) -> list[list[dict]]:
    trajectories = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise TrainConfigError(f"{path}:{number} is not valid JSON: {error}") from error
        messages = record.get("messages") if isinstance(record, dict) else record
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise TrainConfigError(f"{path}:{number} must be a list of messages or an object with 'messages'.")
        trajectories.append(messages)
    return trajectories


def load_expert_trajectories(*, count: int, seed_start: int, backend_name: str | None) -> list[list[dict]]:
    from sandboxes import get_backend
    from training.tasks.toy import generate_toy_task, toy_task_seeds
    from training.train.scripted_expert import expert_trajectory_create

    backend = get_backend(backend_name)
    return [
        expert_trajectory_create(task=generate_toy_task(seed), backend=backend).messages
        for seed in toy_task_seeds(split="train", count=count, start=seed_start)
    ]


DatabaseTrajectories = Callable[[int], list[list[dict]]]
"""Reads up to N recorded successful trajectories; the web app passes its selector in, since training
sits below the web app and never imports it."""


def collect_trajectories(
    config: SFTConfig, *, database_trajectories: DatabaseTrajectories | None = None
) -> list[list[dict]]:
    trajectories: list[list[dict]] = []
    if config.database_limit:
        if database_trajectories is None:
            raise TrainConfigError("database_limit needs a source of recorded trajectories (run it through manage.py sft).")
        trajectories += database_trajectories(config.database_limit)
    for path in config.jsonl_files:
        trajectories += load_jsonl_trajectories(path)
    if config.expert_tasks:
        trajectories += load_expert_trajectories(
            count=config.expert_tasks, seed_start=config.expert_seed_start, backend_name=config.sandbox_backend
        )
    if not trajectories:
        raise TrainConfigError("No trajectories found in the configured sources; SFT has nothing to learn from.")
    return trajectories


def sft(
    config: SFTConfig,
    *,
    context: DistributedContext | None = None,
    trajectories: list[list[dict]] | None = None,
    database_trajectories: DatabaseTrajectories | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Run (or resume) SFT; `trajectories` overrides the configured sources (already collected)."""
    # 1. Starting model and tokenizer.
    initial_weights = None
    if config.init_checkpoint is not None:
        source_model, tokenizer, _ = load_checkpoint(config.init_checkpoint)
        # Rotary positions carry no weights, so a checkpoint with a shorter context is extended to max_seq_len.
        model_config = replace(source_model.config, max_seq_len=max(source_model.config.max_seq_len, config.max_seq_len))
        source_state = source_model.state_dict()

        def initial_weights(model) -> None:
            model.load_state_dict(source_state)
    else:
        # Rotary positions carry no weights, so a fresh model is simply built for the SFT length.
        model_config = ModelConfig.named(config.model, max_seq_len=config.max_seq_len)
        tokenizer = default_tokenizer(model_config.vocab_size)
    # 2. Trajectories -> token ids with an assistant-only loss mask.
    if trajectories is None:
        trajectories = collect_trajectories(config, database_trajectories=database_trajectories)
    tools = openai_tool_schemas()
    examples = [
        _tokenize(messages=messages, tools=tools, tokenizer=tokenizer, context_loss=config.context_loss)
        for messages in trajectories
    ]
    data = MaskedExamples(
        examples=examples, pad_id=tokenizer.pad_id, max_seq_len=config.max_seq_len, seed=config.loop.seed
    )

    # 3. Train (resuming when run_dir already holds a checkpoint).
    return train_supervised(
        model_config=model_config,
        data=data,
        config=config.loop,
        run_dir=config.run_dir,
        run_config={"stage": "sft", "trajectories": len(trajectories), **asdict(config)},
        context=context,
        initial_weights=initial_weights,
        tokenizer=tokenizer,
        on_step=on_step,
    )
