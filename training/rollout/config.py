"""The typed configuration of an asynchronous RL run (training.rollout.driver).

``AsyncRLConfig`` is flat on purpose: its fields, each documented by the docstring under it, are the launch
form of the web app (webapp.experiments.selectors.experiment_form_fields), the JSON stored with every
experiment and read by the driver process, and the driver's command line (``config_argument_parser``
generates one flag per field, its docstring as help). The nested configs the pieces of a run read are
composed from it, one property each: ``grpo_config`` (training.train.grpo.GRPOConfig), ``optimizer_config``
(training.train.loop.OptimizerConfig: the lr schedule), ``reward_config`` (training.tasks.reward.RewardConfig)
and ``scheduler_config`` (training.rollout.scheduler.SchedulerConfig); ``update_config_for`` puts the first two
into the learner's RLConfig. Importing this module does not import torch: the web process validates launch
forms with it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.devices import gpu_request_problem
from training.rollout.scheduler import SchedulerConfig, SchedulerConfigError
from training.train.objective_options import objective_options_problem

if TYPE_CHECKING:  # torch-free at import time: the web process validates launch configs with this module
    from training.tasks.reward import RewardConfig
    from training.train.grpo import GRPOConfig
    from training.train.loop import OptimizerConfig
    from training.train.rl import RLConfig


EXPERT_PRECISIONS = ("fp32", "bf16", "mxfp8")
"""training.model.config.PRECISIONS (not imported: this module stays torch-free)."""


class AsyncRLConfigError(ValueError):
    """Contradictory settings of an asynchronous RL run; the message says how to fix them."""


@dataclass
class AsyncRLConfig:
    """One asynchronous GRPO run on toy bug-fixing tasks."""

    run_dir: str
    """Checkpoints, metrics.jsonl and rollouts.jsonl go here; starting again on it resumes the run."""
    init_checkpoint: str
    """Policy checkpoint to start from (normally the SFT result), or an imported model's directory."""
    policy_model: str | None = dataclasses.field(default=None, metadata={"group": "run", "advanced": False})
    """A registered (imported Hugging Face) model to start from, chosen from the Models list; the web app
    points init_checkpoint at its files. Its own chat template renders the rollouts and its family's syntax
    parses their tool calls. Empty: start from init_checkpoint."""
    precision: str | None = dataclasses.field(default=None, metadata={"group": "infrastructure", "advanced": True})
    """Numerics of the policy's expert matmuls in the learner and the inference actors: "fp32", "bf16" or
    "mxfp8" (block-scaled FP8: the model's widths must be multiples of 32). Empty keeps the checkpoint's."""
    learner_gpus: float = dataclasses.field(default=0.0, metadata={"group": "infrastructure", "advanced": True})
    """GPUs the learner asks Ray for. 0 trains in the driver's process on the CPU; more runs the learner as a
    Ray actor on its GPU(s) (fp32 master weights there, expert matmuls in `precision` or bf16), driven by the
    same few calls (update, weights, save). A fraction shares one GPU; above 1, whole GPUs only."""
    inference_gpus: float = dataclasses.field(default=0.0, metadata={"group": "infrastructure", "advanced": True})
    """GPUs each inference actor asks Ray for (0.5 puts two actors on one GPU). 0 generates on the CPU. A run
    whose GPUs (learner_gpus + inference_actors x inference_gpus) exceed its Ray cluster's is refused at start."""
    steps: int = 10
    """Policy updates to run in total (a resumed run continues up to this number)."""
    tasks: int = 16
    """Size of the pool of train-split toy tasks, cycled through in order."""
    task_seed_start: int = 0
    """First train-split toy task index of the pool."""
    task_set: int | None = None
    """Id of a ready mined task set (the Task sets page) whose train-split tasks are the pool instead of toy
    tasks (at most `tasks` of them, cycled); the web app writes them to the run directory at launch. Empty:
    toy tasks."""
    group_size: int = 4
    """Rollouts per task; GRPO advantages are relative to the group."""
    groups_per_step: int = 2
    """Complete groups consumed by one policy update."""
    max_staleness: int = 1
    """Largest policy-version lag between generating a sample and training on it (0 = synchronous)."""
    probe_size: int = 0
    """Rollouts of each group run first; when they all earn the same reward the group is abandoned
    (logged, not trained on) instead of finishing it for a zero gradient. 0 runs every group in full."""
    rollout_workers: int = 4
    """Environment servers (Ray actors), each running one rollout at a time."""
    inference_actors: int = 1
    """Generation-engine actors; rollout workers are spread over them round-robin."""
    max_turns: int = 4
    """Tool-calling turns per rollout."""
    max_tokens_per_turn: int = 256
    """Completion tokens per model call. The toy tier's fixing edit takes up to ~200 tokens of the default
    tokenizer as an edit_file call (99 median) and up to 114 as the expert's replace_lines call (87
    median), so a lower cap makes tasks unsolvable."""
    context_tokens: int = 4096
    """Context the agent loop may fill; must fit the model's max_seq_len."""
    temperature: float = 1.0
    """Sampling temperature of rollouts and of the training logprobs."""
    rollout_wall_time_s: float = 300.0
    """Wall-clock limit of one rollout's agent loop."""
    lr: float = 1e-5
    """Peak learning rate of the policy update (constant after the warmup unless min_lr_ratio < 1)."""
    warmup_steps: int = 0
    """Updates of linear warmup from ~0 to lr. A fresh Adam's first steps move every parameter by ~lr
    whatever the gradient's size (its second-moment estimate is still one sample); a ramp lets that
    estimate settle before the steps reach full size."""
    min_lr_ratio: float = 1.0
    """Learning rate at the last of `steps` updates as a fraction of lr, reached by a cosine decay over the
    last lr_decay_fraction of the updates after the warmup; 1 keeps lr constant. The schedule counts
    updates (policy versions, trained or not: a group whose rollouts agree still takes one), so a run
    stopped by a clock should set steps to the updates its budget allows."""
    lr_decay_fraction: float = 1.0
    """Share of the updates after the warmup over which lr decays to min_lr_ratio * lr (the ones before
    hold lr); 0.25 anneals over the last quarter."""
    time_budget_minutes: float | None = None
    """Training wall-clock budget: the run stops when it is spent (after the update in progress), and the
    lr decay follows the clock as well as the update count (whichever is further along; on the clock it
    covers the last lr_decay_fraction of the budget), so a clock-bound run ends its decay at the clock
    whatever rate the machine reaches. Time spent before a pause counts: it is kept in checkpoints. None
    runs until `steps` updates exist."""
    gain_lr_scale: float = 1.0
    """Learning-rate multiplier for normalisation gains (training.train.loop.OptimizerConfig): at an RL
    learning rate Adam barely moves a gain of ~1.0, and the gains set how sharp the policy samples."""
    negative_advantage_weight: float = 1.0
    """Weight of below-group-mean rollouts in the update: 1 is GRPO, 0 reinforces only rollouts that
    beat their group (RAFT-style, training.train.grpo.GRPOConfig.negative_advantage_weight)."""
    entropy_coef: float = 0.0
    """Weight of the policy's mean token entropy in the update (training.train.grpo.GRPOConfig.entropy_coef):
    0 leaves it out, > 0 is an exploration bonus, < 0 sharpens the policy towards its modes. It acts on the
    tokens the update trains: the rollouts of groups whose rewards differ."""
    entropy_scope: str = "all"
    """Rollouts the entropy term covers: "all" trained ones, or "positive" (only those that beat their
    group, so sharpening does not lock in wrong choices; training.train.grpo.GRPOConfig.entropy_scope)."""
    normalize_advantage_std: bool = False
    """Divide each group's centred rewards by the group's reward standard deviation, as the GRPO paper does
    (training.train.grpo.GRPOConfig.normalize_advantage_std): a rare success in a group of 16 then weighs ~4
    times a success in an even group instead of ~2 times, so hard tasks' rare wins count for more."""
    expert_guidance: bool = False
    """When none of a group's valid rollouts passed, the scripted expert solves the task in a sandbox and its
    trajectory joins the group as one more member, scored by the learner's own logprobs (importance ratio 1):
    the group then carries a gradient towards the fix instead of none (training.train.guidance)."""
    kl_coef: float = 0.0
    """Weight of the per-token KL penalty to init_checkpoint's policy (training.train.grpo.GRPOConfig.kl_coef):
    0 leaves it out; > 0 keeps the policy near where it started, at the cost of a second model in the learner
    and one more forward pass per update."""
    updates_per_step: int = 1
    """Optimizer steps on each batch (later ones are off-policy, handled by the clipped ratio)."""
    partial_credit: bool = False
    """Reward the fraction of passing hidden tests instead of 0/1."""
    reference_similarity_weight: float = 0.0
    """A failed rollout scores this weight times its closest edit_file call's similarity to the task's
    reference fix (SWE-RL-style shaping, training.tasks.reward.RewardConfig.reference_similarity_weight):
    groups where every rollout failed then still train, towards the near-misses. 0 keeps rewards test-only;
    must be below 1 so a pass always scores highest. Held-out evaluation never uses it. It can cost
    held-out pass@1: the all-fail groups it trains sharpen failing edits (measurements in docs/notebook/)."""
    copy_constraint: bool = True
    """The inference actors let edit_file's old_str be only text of the conversation's tool results
    (training.copy_constraint), exactly as the product serves the model; False samples it freely."""
    sandbox_backend: str | None = None
    """Sandbox backend the rollout workers use (None: the configured default)."""
    sandbox_runtime: str | None = None
    """OCI runtime (isolation tier) of the rollout workers' Docker sandboxes, e.g. ``runsc`` (gVisor);
    None: the configured ``SANDBOX_DOCKER_RUNTIME``. Fleet hosts (``sandbox_hosts``) run their own."""
    ray_address: str | None = None
    """Ray cluster to join; None starts a private local instance."""
    ray_num_cpus: int = 2
    """CPUs of the private local Ray instance (ignored when joining a cluster)."""
    sandbox_hosts: bool = False
    """Run rollout sandboxes on the fleet's sandbox-host actors (sandboxes.fleet) instead of in each
    rollout worker; a private local Ray offers rollout_workers sandbox slots for them."""
    fleet_heartbeats: bool = True
    """With sandbox_hosts, hosts report heartbeats to the fleet dashboard (webapp.fleet)."""
    seed: int = 0
    """Seeds rollout sampling and the torch RNG."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk."""

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_lr_schedule()
        self._check_delegated()
        if self.sandbox_runtime is not None:
            from sandboxes.settings import RUNTIME_NAME

            if not isinstance(self.sandbox_runtime, str) or not RUNTIME_NAME.fullmatch(self.sandbox_runtime):
                raise AsyncRLConfigError(f"sandbox_runtime={self.sandbox_runtime!r} is not an OCI runtime name (e.g. runsc)")
            if self.sandbox_hosts:
                raise AsyncRLConfigError("sandbox_runtime applies to the rollout workers' own sandboxes; fleet hosts "
                                         "(sandbox_hosts) run their SANDBOX_DOCKER_RUNTIME")
        if self.inference_actors > self.rollout_workers:
            raise AsyncRLConfigError(
                f"inference_actors={self.inference_actors} exceeds rollout_workers={self.rollout_workers}; "
                "extra inference actors would never get a request, lower inference_actors"
            )
        for name in ("learner_gpus", "inference_gpus"):
            problem = gpu_request_problem(name, getattr(self, name))
            if problem:
                raise AsyncRLConfigError(problem)
        if self.precision is not None and self.precision not in EXPERT_PRECISIONS:
            raise AsyncRLConfigError(f"precision must be one of {EXPERT_PRECISIONS} or empty, got {self.precision!r}")
        if not Path(self.init_checkpoint).is_dir():
            raise AsyncRLConfigError(
                f"init_checkpoint {self.init_checkpoint!r} is not a checkpoint directory; point it at a "
                "directory written by training.checkpoint.save_checkpoint (e.g. the SFT result)"
            )

    def _check_sizes(self) -> None:
        """Counts, the group size, staleness and temperature."""
        for name in (
            "steps",
            "tasks",
            "groups_per_step",
            "rollout_workers",
            "inference_actors",
            "max_turns",
            "max_tokens_per_turn",
            "updates_per_step",
            "keep_checkpoints",
            "ray_num_cpus",
        ):
            if getattr(self, name) < 1:
                raise AsyncRLConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise AsyncRLConfigError("group_size must be >= 2: the GRPO baseline is the mean of the group")
        if self.max_staleness < 0:
            raise AsyncRLConfigError("max_staleness must be >= 0 (0 runs synchronous batches)")
        if self.temperature <= 0:
            raise AsyncRLConfigError("temperature must be > 0: greedy rollouts of one task are identical")

    def _check_lr_schedule(self) -> None:
        """The learning rate, its warmup and decay, and the time budget."""
        if self.lr <= 0:
            raise AsyncRLConfigError("lr must be > 0")
        if self.warmup_steps < 0:
            raise AsyncRLConfigError(f"warmup_steps must be >= 0 (0 starts at the full lr), got {self.warmup_steps}")
        if self.gain_lr_scale <= 0:
            raise AsyncRLConfigError(f"gain_lr_scale must be > 0 (1 trains gains at lr), got {self.gain_lr_scale}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise AsyncRLConfigError(f"min_lr_ratio must be in [0, 1] (1 keeps lr constant), got {self.min_lr_ratio}")
        if not 0 < self.lr_decay_fraction <= 1:
            raise AsyncRLConfigError(
                f"lr_decay_fraction must be in (0, 1] (1 decays over every update after the warmup), "
                f"got {self.lr_decay_fraction}"
            )
        if self.time_budget_minutes is not None and not self.time_budget_minutes > 0:
            raise AsyncRLConfigError(
                f"time_budget_minutes must be > 0 (leave it empty to run until `steps` updates), "
                f"got {self.time_budget_minutes}"
            )

    def _check_delegated(self) -> None:
        """The checks the objective, the reward and the scheduler own, reworded as this config's errors."""
        problem = objective_options_problem(
            negative_advantage_weight=self.negative_advantage_weight,
            entropy_coef=self.entropy_coef,
            entropy_scope=self.entropy_scope,
            kl_coef=self.kl_coef,
        )
        if problem:
            raise AsyncRLConfigError(problem.removesuffix("."))
        from training.tasks.base import TaskError

        try:
            self.reward_config  # noqa: B018 - its checks (the shaping weight's range) are the reward's own
        except TaskError as error:
            raise AsyncRLConfigError(str(error).removeprefix("RewardConfig.")) from error
        try:
            self.scheduler_config  # noqa: B018 - its checks (probe_size) are the scheduler's own
        except SchedulerConfigError as error:
            # Without the class prefix the message starts with the field, which the launch form keys on.
            raise AsyncRLConfigError(str(error).removeprefix("SchedulerConfig.")) from error

    @property
    def reward_config(self) -> RewardConfig:
        """The RewardConfig every rollout of this run is scored with."""
        from training.tasks.reward import RewardConfig

        return RewardConfig(
            partial_credit=self.partial_credit, reference_similarity_weight=self.reference_similarity_weight
        )

    @property
    def grpo_config(self) -> GRPOConfig:
        """The GRPO objective's settings (the rest keep GRPOConfig's defaults)."""
        from training.train.grpo import GRPOConfig

        return GRPOConfig(
            negative_advantage_weight=self.negative_advantage_weight,
            entropy_coef=self.entropy_coef,
            entropy_scope=self.entropy_scope,
            kl_coef=self.kl_coef,
            normalize_advantage_std=self.normalize_advantage_std,
        )

    @property
    def optimizer_config(self) -> OptimizerConfig:
        """The optimizer and its lr schedule (no weight decay, as is usual for RL)."""
        from training.train.loop import OptimizerConfig

        return OptimizerConfig(
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            weight_decay=0.0,
            min_lr_ratio=self.min_lr_ratio,
            decay_fraction=self.lr_decay_fraction,
            gain_lr_scale=self.gain_lr_scale,
        )

    @property
    def scheduler_config(self) -> SchedulerConfig:
        """The rollout scheduler's settings: one in-flight rollout per worker."""
        return SchedulerConfig(
            max_in_flight=self.rollout_workers,
            group_size=self.group_size,
            groups_per_step=self.groups_per_step,
            max_staleness=self.max_staleness,
            probe_size=self.probe_size,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AsyncRLConfig:
        known = {item.name for item in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise AsyncRLConfigError(f"unknown AsyncRLConfig fields {unknown}; known fields: {sorted(known)}")
        return cls(**data)


def update_config_for(config: AsyncRLConfig) -> RLConfig:
    """The RLConfig the learner (training.train.learner.Learner) reads its settings from, matching this run's."""
    from training.train.rl import RLConfig

    return RLConfig(
        run_dir=config.run_dir,
        init_checkpoint=config.init_checkpoint,
        tasks=config.tasks,
        task_seed_start=config.task_seed_start,
        tasks_per_step=min(config.groups_per_step, config.tasks),
        group_size=config.group_size,
        steps=config.steps,
        updates_per_step=config.updates_per_step,
        temperature=config.temperature,
        routing_replay=True,
        seed=config.seed,
        keep_checkpoints=config.keep_checkpoints,
        grpo=config.grpo_config,
        max_turns=config.max_turns,
        max_tokens_per_turn=config.max_tokens_per_turn,
        optimizer=config.optimizer_config,
        precision=config.precision,
    )


def dataclass_field_docs(cls: type) -> dict[str, str]:
    """{field: the docstring under it} of a dataclass (and of its dataclass bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for node, following in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _field_parser(annotation: Any) -> tuple[type, bool]:
    """(scalar type, optional) of a field's resolved annotation: int, float, str or bool, maybe `| None`."""
    arguments = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in arguments:
        (inner,) = [argument for argument in arguments if argument is not type(None)]
        return inner, True
    return annotation, False


def config_argument_parser(cls: type | None = None, *, description: str = "") -> argparse.ArgumentParser:
    """A command line with one flag per field of a flat config dataclass (AsyncRLConfig by default):
    ``--field-name VALUE`` (``--field-name/--no-field-name`` for booleans, ``none`` for an optional field's
    None), typed from the annotation, the field's docstring as help. Unset flags stay out of the result
    (argparse.SUPPRESS), so the dataclass's own defaults apply."""
    cls = cls or AsyncRLConfig
    hints = typing.get_type_hints(cls)
    docs = dataclass_field_docs(cls)
    parser = argparse.ArgumentParser(description=description or (cls.__doc__ or "").strip())
    for item in dataclasses.fields(cls):
        kind, optional = _field_parser(hints[item.name])
        flag = "--" + item.name.replace("_", "-")
        help_text = docs.get(item.name, "").replace("%", "%%")
        required = item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING
        if kind is bool:
            parser.add_argument(flag, dest=item.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text)
            continue
        if kind not in (int, float, str):
            raise TypeError(f"{cls.__name__}.{item.name}: a {kind} field has no command-line form")

        def convert(text: str, kind: type = kind, optional: bool = optional) -> Any:
            return None if optional and text.lower() == "none" else kind(text)

        convert.__name__ = kind.__name__
        parser.add_argument(flag, dest=item.name, type=convert, default=argparse.SUPPRESS,
                            help=help_text + (" (required)" if required else ""))
    return parser
