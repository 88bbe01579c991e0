"""Three ways to spend the same CPU time on a fine-tuned policy, from one starting checkpoint.

- ``rl``: the documented asynchronous GRPO recipe (training.rollout.driver.run_async_rl with the
  settings of models/demo/README.md), its clock set to the budget.
- ``expert-sft``: rounds of (generate fresh scripted-expert trajectories in real sandboxes, then SFT on
  every trajectory generated so far, training.train.sft.sft), from the previous round's checkpoint.
- ``rft``: rejection-sampling fine-tuning, rounds of (sample the current policy on fresh training tasks
  in real sandboxes with the RL rollout code, keep the rollouts whose hidden tests pass, then SFT on every
  kept trajectory so far), from the previous round's checkpoint (expert iteration / ReST-style).

Everything the recipe does counts against its budget (data generation, sampling, training, checkpoints),
except loading the starting model and the held-out evaluations, which are run afterwards on the
checkpoints a recipe leaves at its curve points. Each SFT round starts a fresh optimizer (AdamW moments
are not carried across rounds); the lr is constant.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

RECIPES = ("rl", "expert-sft", "rft")
EXPERT_SEED_START = 12_000
"""First train-split toy seed of the expert recipe: models/sft's SFT used seeds 0-11999."""
RFT_SEED_START = 200_000
"""First train-split toy seed the rejection-sampling recipe samples on (never the expert's)."""
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")


@dataclass
class RecipeConfig:
    """One recipe run at a fixed CPU-time budget."""

    recipe: str
    """One of RECIPES."""

    init_checkpoint: str
    """Checkpoint every recipe starts from (models/sft)."""

    run_dir: str
    """Directory of this recipe's checkpoints, logs and curve checkpoints."""

    minutes: float
    """Wall-clock budget on this machine (data, sampling and training; not the held-out evaluations)."""

    seed: int = 0
    """Seeds RL rollouts, SFT data order and the tasks a recipe draws (offset by seed x 50,000)."""

    curve_points: int = 4
    """Checkpoints kept at even fractions of the budget, evaluated for the pass@1-against-minutes curve."""

    sft_lr: float = 1e-4
    """lr of the SFT rounds after the warmup, held constant. Kept well below the starting checkpoint's peak
    SFT lr: restarting a fine-tuned policy at its peak lr undoes much of what it learned."""

    sft_warmup_steps: int = 10
    """Linear lr warmup of the recipe's SFT (once: later rounds resume its optimizer)."""

    sft_batch_size: int = 4
    """Sequences per SFT step."""

    max_seq_len: int = 3072
    """Longest SFT sequence (the context of models/sft)."""

    data_share: float = 0.4
    """Share of each SFT round spent generating data (expert runs or policy samples); the rest trains."""

    workers: int = 4
    """Sandboxes run at the same time while generating data."""

    rft_group_size: int = 4
    """Samples per training task in the rejection-sampling recipe."""

    rft_temperature: float = 1.0
    """Sampling temperature of the rejection-sampling recipe's rollouts."""

    max_turns: int = 5
    """Agent turns per rollout (RL and rejection sampling)."""

    rl_options: dict = field(default_factory=dict)
    """AsyncRLConfig fields overriding the documented RL recipe's (e.g. {"rollout_workers": 2})."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES}, got {self.recipe!r}")
        if not (self.minutes > 0 and self.minutes <= 24 * 60):
            raise ValueError(f"minutes must be in (0, 1440], got {self.minutes}")
        if not 1 <= self.curve_points <= 20 or not 0 < self.data_share < 1 or self.workers < 1:
            raise ValueError("curve_points in [1, 20], data_share in (0, 1) and workers >= 1")
        if not Path(self.init_checkpoint).is_dir():
            raise ValueError(f"init_checkpoint {self.init_checkpoint!r} is not a checkpoint directory")


@dataclass
class CurvePoint:
    """A checkpoint a recipe left at some point of its budget."""

    minutes: float
    """Wall-clock minutes of the recipe when the checkpoint was written."""

    checkpoint: str
    """Model files (config, weights, tokenizer) of that moment."""

    step: int
    """Optimizer steps of the recipe so far."""

    pass_at_1: float | None = None
    """Held-out pass@1 of the checkpoint (filled by the evaluation after the run)."""


@dataclass
class RecipeRun:
    """What one recipe did with its budget."""

    config: RecipeConfig
    """The recipe's settings."""

    final_checkpoint: str
    """The checkpoint at the end of the budget."""

    minutes: float
    """Wall-clock minutes it actually ran (the budget plus the last step or round it finished)."""

    steps: int
    """Optimizer steps in all."""

    curve: list[CurvePoint]
    """Checkpoints along the budget, the last one the final checkpoint."""

    rows: list[dict]
    """Per-step metrics, each with ``minutes`` and a recipe-wide ``step`` (what the experiments page plots)."""

    data: dict = field(default_factory=dict)
    """Data the recipe generated: trajectories made, kept and tried."""


def _copy_model(source: Path, target: Path) -> str:
    target.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        shutil.copyfile(source / name, target / name)
    return str(target)


def run_recipe(config: RecipeConfig) -> RecipeRun:
    """Run one recipe for its budget; returns its checkpoints, curve points and step rows."""
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    if config.recipe == "rl":
        return _run_rl(config)
    return _run_sft_rounds(config)


# --- RL -------------------------------------------------------------------------------------------


def rl_config(config: RecipeConfig):
    """The documented RL recipe (models/demo/README.md) at this budget and seed."""
    from training.rollout.driver import AsyncRLConfig

    values = dict(
        run_dir=str(Path(config.run_dir) / "run"), init_checkpoint=config.init_checkpoint, steps=100_000,
        time_budget_minutes=config.minutes, tasks=2000, group_size=16, groups_per_step=1, max_staleness=2,
        rollout_workers=6, inference_actors=2, max_turns=config.max_turns, temperature=1.4, lr=3e-5,
        warmup_steps=20, min_lr_ratio=0.1, lr_decay_fraction=0.3, entropy_coef=-0.5, entropy_scope="positive",
        gain_lr_scale=100.0, copy_constraint=True, keep_checkpoints=2, seed=config.seed,
        task_seed_start=50_000 * config.seed,
    )
    values.update(config.rl_options)
    return AsyncRLConfig(**values)


def _run_rl(config: RecipeConfig) -> RecipeRun:
    from training.rollout.driver import run_async_rl
    from training.train.state import latest_checkpoint

    rl = rl_config(config)
    started = time.monotonic()
    boundaries = [config.minutes * (index + 1) / config.curve_points for index in range(config.curve_points)]
    curve: list[CurvePoint] = []
    rows: list[dict] = []

    def on_step(metrics: dict) -> None:
        minutes = metrics.get("training_seconds", time.monotonic() - started) / 60
        rows.append({**metrics, "minutes": minutes})
        # Checkpoints are written before on_step: the newest one is this step's.
        if len(curve) < len(boundaries) - 1 and minutes >= boundaries[len(curve)]:
            latest = latest_checkpoint(rl.run_dir)
            target = Path(config.run_dir) / "curve" / f"point-{len(curve) + 1}"
            curve.append(CurvePoint(minutes=minutes, checkpoint=_copy_model(latest, target), step=metrics["step"]))

    run_async_rl(rl, on_step=on_step, stop=threading.Event())
    final = latest_checkpoint(rl.run_dir)
    if final is None:
        raise RuntimeError(f"the RL recipe made no update within {config.minutes} minutes")
    minutes = (time.monotonic() - started) / 60
    final_copy = _copy_model(final, Path(config.run_dir) / "final")
    curve.append(CurvePoint(minutes=rows[-1]["minutes"] if rows else minutes, checkpoint=final_copy,
                            step=rows[-1]["step"] if rows else 0))
    return RecipeRun(config=config, final_checkpoint=final_copy, minutes=minutes, steps=len(rows), curve=curve,
                     rows=rows, data={"rollouts": sum(row.get("rollouts", 0) for row in rows)})


# --- SFT rounds: fresh expert trajectories, or the policy's own passing rollouts ---------------------


def _expert_batch(config: RecipeConfig, seeds: list[int]) -> list[list[dict]]:
    from sandboxes import get_backend
    from training.tasks.toy import generate_toy_task
    from training.train.scripted_expert import ExpertTrajectoryError, expert_trajectory_create

    backend = get_backend(None)

    def one(seed: int) -> list[dict] | None:
        try:
            return expert_trajectory_create(task=generate_toy_task(seed), backend=backend).messages
        except ExpertTrajectoryError:
            return None

    with ThreadPoolExecutor(max_workers=config.workers) as pool:
        return [messages for messages in pool.map(one, seeds) if messages is not None]


def _policy_batch(config: RecipeConfig, checkpoint: str, seeds: list[int]) -> tuple[list[list[dict]], int]:
    """(passing trajectories, rollouts tried): config.rft_group_size samples of each task by the current policy."""
    from sandboxes import get_backend
    from training.agent.config import AgentLimits
    from training.engine import EngineConfig
    from training.rollout.config import AsyncRLConfig
    from training.serving import ChatModel
    from training.tasks.toy import generate_toy_task
    from training.train.rollouts import rollouts_collect

    chat_model = ChatModel.load(checkpoint, engine_config=EngineConfig(max_batch_size=config.workers))
    try:
        per_turn = AsyncRLConfig.max_tokens_per_turn
        limits = AgentLimits(
            max_turns=config.max_turns, max_tokens=config.max_turns * per_turn * 2, max_tokens_per_turn=per_turn,
            context_tokens=chat_model.model.config.max_seq_len, temperature=config.rft_temperature,
        )
        records = rollouts_collect(
            tasks=[generate_toy_task(seed) for seed in seeds], group_size=config.rft_group_size,
            backend=get_backend(None), chat_model=chat_model, limits=limits, seed=config.seed * 7919 + seeds[0],
            max_workers=config.workers,
        )
    finally:
        chat_model.close()
    kept = [record.agent_result.messages for record in records if record.valid and record.passed and record.agent_result]
    return kept, len(records)


def _generate_until(config: RecipeConfig, deadline: float, checkpoint: str, next_seed: Callable[[int], list[int]],
                    data: dict) -> list[list[dict]]:
    """Batches of trajectories until the deadline (at least one batch, so every round has data to train on)."""
    made: list[list[dict]] = []
    while True:
        if config.recipe == "expert-sft":
            seeds = next_seed(config.workers)
            batch = _expert_batch(config, seeds)
            data["tried"] = data.get("tried", 0) + len(seeds)
        else:
            seeds = next_seed(max(1, config.workers // 2))
            batch, tried = _policy_batch(config, checkpoint, seeds)
            data["tried"] = data.get("tried", 0) + tried
        made += batch
        if time.monotonic() >= deadline:
            return made


def _sft_round(config: RecipeConfig, *, index: int, new: list[list[dict]], data_files: list[str], deadline: float,
               rows: list[dict], started: float, data: dict) -> str:
    """SFT on every trajectory so far (this round's `new` ones are written to its JSONL and added to `data_files`)
    until `deadline`, resuming the recipe's one SFT run (weights, AdamW moments, step count; the first round starts from config.init_checkpoint);
    appends its step rows (recipe minutes); returns the round's checkpoint. The loop's clock starts after
    loading and tokenizing, so the budget given leaves out the preparation the previous round took
    (data["sft_prep_s"]), and the round ends near `deadline`."""
    import json

    from training.train.loop import LoopConfig, OptimizerConfig
    from training.train.sft import SFTConfig, sft

    round_dir = Path(config.run_dir) / f"round-{index + 1}"
    round_dir.mkdir(parents=True, exist_ok=True)
    data_file = round_dir / "trajectories.jsonl"
    data_file.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in new))
    data_files.append(str(data_file))

    called, first = time.monotonic(), [True]

    def on_step(metrics: dict) -> None:
        if first.pop() if first else False:
            data["sft_prep_s"] = time.monotonic() - called - metrics["step_seconds"]
        rows.append({**metrics, "minutes": (time.monotonic() - started) / 60, "data_files": len(data_files)})

    result = sft(
        SFTConfig(
            run_dir=str(Path(config.run_dir) / "sft"), init_checkpoint=config.init_checkpoint,
            jsonl_files=tuple(data_files),
            max_seq_len=config.max_seq_len,
            loop=LoopConfig(
                steps=1_000_000, batch_size=config.sft_batch_size, micro_batch_size=min(2, config.sft_batch_size),
                seed=config.seed, checkpoint_every=0, keep_checkpoints=1,
                time_budget_s=max(1.0, deadline - called - data.get("sft_prep_s", 0.0)),
                optimizer=OptimizerConfig(lr=config.sft_lr, warmup_steps=config.sft_warmup_steps, min_lr_ratio=1.0),
            ),
        ),
        on_step=on_step,
    )
    return str(result.final_checkpoint)


def _run_sft_rounds(config: RecipeConfig) -> RecipeRun:
    started = time.monotonic()
    first_seed = (EXPERT_SEED_START if config.recipe == "expert-sft" else RFT_SEED_START) + 50_000 * config.seed
    cursor = [first_seed]

    def next_seed(count: int) -> list[int]:
        seeds = list(range(cursor[0], cursor[0] + count))
        cursor[0] += count
        return seeds

    checkpoint, made, data_files, curve, rows, data = config.init_checkpoint, 0, [], [], [], {}
    for index in range(config.curve_points):
        round_end = started + config.minutes * 60 * (index + 1) / config.curve_points
        round_seconds = max(1.0, round_end - time.monotonic())
        new = _generate_until(config, time.monotonic() + config.data_share * round_seconds, checkpoint, next_seed, data)
        made += len(new)
        if not new and not data_files:  # nothing passed yet (rejection sampling of a weak policy): only sampled
            curve.append(CurvePoint(minutes=(time.monotonic() - started) / 60, checkpoint=checkpoint, step=len(rows)))
            continue
        # With nothing new (no rollout passed this round) the round trains on what earlier rounds kept.
        checkpoint = _sft_round(config, index=index, new=new, data_files=data_files, deadline=round_end,
                                rows=rows, started=started, data=data)
        target = Path(config.run_dir) / "curve" / f"point-{index + 1}"
        curve.append(CurvePoint(minutes=(time.monotonic() - started) / 60,
                                checkpoint=_copy_model(Path(checkpoint), target), step=len(rows)))
    data["trajectories"] = made
    return RecipeRun(config=config, final_checkpoint=curve[-1].checkpoint, minutes=(time.monotonic() - started) / 60,
                     steps=len(rows), curve=curve, rows=rows, data=data)


SUMMARY_FILE, ROWS_FILE = "recipe.json", "rows.jsonl"


def recipe_save(run: RecipeRun) -> None:
    """The finished run in its run_dir: recipe.json (config, checkpoints, curve, data) and rows.jsonl."""
    import json

    summary = asdict(run)
    rows = summary.pop("rows")
    directory = Path(run.config.run_dir)
    (directory / ROWS_FILE).write_text("".join(json.dumps(row, default=str) + "\n" for row in rows))
    (directory / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str))


def recipe_load(config: RecipeConfig) -> RecipeRun | None:
    """The finished run `recipe_save` left in config.run_dir, or None; refused when it ran other settings."""
    import json

    directory = Path(config.run_dir)
    if not (directory / SUMMARY_FILE).is_file() or not (directory / ROWS_FILE).is_file():
        return None
    summary = json.loads((directory / SUMMARY_FILE).read_text())
    stored = RecipeConfig(**summary["config"])
    if stored != config:
        raise ValueError(f"{directory} holds a run with other settings ({stored}); give another run_dir")
    rows = [json.loads(line) for line in (directory / ROWS_FILE).read_text().splitlines() if line.strip()]
    curve = [CurvePoint(**point) for point in summary["curve"]]
    return RecipeRun(config=stored, final_checkpoint=summary["final_checkpoint"], minutes=summary["minutes"],
                     steps=summary["steps"], curve=curve, rows=rows, data=summary["data"])
