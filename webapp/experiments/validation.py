"""Checks of an experiment's config: types from the typed AsyncRLConfig, ranges from settings.

The launch form, the REST serializer and the service all call `experiment_config_check`, so a value
is refused the same way everywhere, by field name, before it reaches the driver or the database.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError

from webapp.core.validation import Range, dataclass_field_kinds, ranges_check, typed_fields_check

SERVER_CONTROLLED_FIELDS = ("run_dir", "ray_address", "sandbox_backend")
"""Fields of AsyncRLConfig the user may not set: derived from the experiment or the server."""


def experiment_config_bounds() -> dict[str, Range]:
    """The range of every numeric AsyncRLConfig field a user may set (upper ends from settings)."""
    steps = settings.EXPERIMENT_MAX_STEPS
    workers = settings.EXPERIMENT_MAX_WORKERS
    return {
        "steps": Range(1, steps),
        "tasks": Range(1, 1_000_000),
        "task_seed_start": Range(0, 1_000_000_000),
        "task_set": Range(1, 2**63 - 1),  # a task set id (webapp.mining); visibility checked by task_set_check
        "group_size": Range(2, 1024),
        "groups_per_step": Range(1, 1024),
        "max_staleness": Range(0, steps),
        "probe_size": Range(0, 1024),
        "rollout_workers": Range(1, workers),
        "inference_actors": Range(1, workers),
        "max_turns": Range(1, settings.AGENT_MAX_TURNS),
        "max_tokens_per_turn": Range(1, settings.AGENT_MAX_CONTEXT_TOKENS),
        "context_tokens": Range(1, settings.AGENT_MAX_CONTEXT_TOKENS),
        "temperature": Range(0, 10),
        "rollout_wall_time_s": Range(1, settings.AGENT_MAX_WALL_TIME_S),
        "lr": Range(0, 1),
        "warmup_steps": Range(0, steps),
        "min_lr_ratio": Range(0, 1),
        "lr_decay_fraction": Range(0, 1),
        "time_budget_minutes": Range(0, 366 * 24 * 60),
        "gain_lr_scale": Range(0, 1000),
        "negative_advantage_weight": Range(0, 1),
        "entropy_coef": Range(-1, 1),
        "kl_coef": Range(0, 1),
        "updates_per_step": Range(1, 100),
        "reference_similarity_weight": Range(0, 1),
        "ray_num_cpus": Range(1, workers),
        "learner_gpus": Range(0, 8),  # fractions below 1, whole numbers above (AsyncRLConfig checks)
        "inference_gpus": Range(0, 8),
        "seed": Range(0, 2**32 - 1),
        "keep_checkpoints": Range(1, 1000),
    }


def _config_class():
    from training.rollout.config import AsyncRLConfig

    return AsyncRLConfig


def checkpoint_from_choices(value: Any, *, owner) -> str:
    """The directory of a registered checkpoint named (or, for clones, equal to) ``value``.

    The same error for every unknown value: it never tells whether a server path exists.
    """
    from webapp.experiments.selectors import checkpoint_choices

    choices = checkpoint_choices(user=owner)
    if isinstance(value, str) and value in choices:
        return choices[value]
    if isinstance(value, str) and value and value in choices.values():
        return value
    names = ", ".join(list(choices)[:30]) or "none are registered (set FLOWSTATE_MODEL_CHECKPOINT)"
    raise ValidationError({"init_checkpoint": f"choose a registered checkpoint by name: {names}"})


def policy_model_directory(values: dict[str, Any], *, owner: Any) -> str:
    """The files of the registered model ``policy_model`` names, which the launching user must be allowed
    to use (the same error for a hidden model as for a missing one). A run starts from a registered model or
    from a checkpoint, not both (a clone carries the model's own directory, which is accepted)."""
    from webapp.registry.selectors import registered_models_visible_to

    name = values["policy_model"]
    model = registered_models_visible_to(user=owner).filter(name=name).first() if owner is not None else None
    if model is None:
        raise ValidationError({"policy_model": f"no registered model {str(name)[:100]!r} is visible to you"})
    given = values.get("init_checkpoint")
    # The launch form shows the configured default checkpoint in init_checkpoint: that is not a second choice.
    if given not in (None, "", "default", settings.MODEL_CHECKPOINT, model.directory):
        raise ValidationError(
            {"policy_model": "start from a registered model or from a checkpoint, not both: clear init_checkpoint"}
        )
    if values.get("expert_guidance"):
        raise ValidationError(
            {"expert_guidance": "the scripted expert's guidance uses the built-in model's tokenizer; turn it off "
                                "for an imported model"}
        )
    return model.directory


def task_set_check(task_set_id: int, *, owner: Any) -> None:
    """A task-set pool must be a ready mined set the launching user can see (and one with train tasks)."""
    from webapp.mining.selectors import task_set_ready_get

    task_set = task_set_ready_get(user=owner, pk=task_set_id) if owner is not None else None
    if task_set is None:
        raise ValidationError({"task_set": f"no ready task set {task_set_id} is visible to you"})
    if not task_set.tasks.filter(split="train").exists():
        raise ValidationError({"task_set": f"task set {task_set_id} has no train-split tasks to train on"})


def experiment_config_check(config: Any, *, run_dir: str = "pending", owner: Any = None) -> dict[str, Any]:
    """The full config as AsyncRLConfig accepts it (server fields filled in), without the server-controlled
    fields; or a ValidationError keyed by the field to fix. Types first, then AsyncRLConfig's own rules
    (their messages explain them), then the ranges. With ``owner`` a given ``init_checkpoint`` must name
    a checkpoint registered for that user (never a typed server path), and a given ``policy_model`` a
    registered model the user may use (its directory becomes init_checkpoint)."""
    from training.rollout.config import AsyncRLConfigError

    if isinstance(config, dict):
        forbidden = {name: f"{name} is set by the server; remove it" for name in SERVER_CONTROLLED_FIELDS
                     if name in config}
        if forbidden:
            raise ValidationError(forbidden)
    try:
        values = typed_fields_check(_config_class(), config)
    except ValidationError as error:
        if hasattr(error, "error_dict"):
            raise
        raise ValidationError({"config": error.messages}) from error
    if values.get("policy_model"):
        values["init_checkpoint"] = policy_model_directory(values, owner=owner)
    elif owner is not None and values.get("init_checkpoint"):
        values["init_checkpoint"] = checkpoint_from_choices(values["init_checkpoint"], owner=owner)
    values.setdefault("init_checkpoint", settings.MODEL_CHECKPOINT or "")
    if values.get("task_set") is not None:
        task_set_check(values["task_set"], owner=owner)
    if values.get("sandbox_runtime"):  # the isolation tiers this server allows, as for tasks
        from webapp.agents.validation import sandbox_runtime_check

        values["sandbox_runtime"] = sandbox_runtime_check(values["sandbox_runtime"]) or None
    server = {"sandbox_backend": settings.SANDBOX_BACKEND, "ray_address": settings.RAY_ADDRESS, "run_dir": run_dir}
    try:
        parsed = _config_class().from_dict({**values, **server})
    except (AsyncRLConfigError, TypeError) as error:
        message = str(error)
        names = sorted(dataclass_field_kinds(_config_class()), key=len, reverse=True)
        field = next((name for name in names if message.startswith(name)), "config")
        raise ValidationError({field: message}) from error
    ranges_check(values, bounds=experiment_config_bounds())
    return {key: value for key, value in parsed.__dict__.items() if key not in SERVER_CONTROLLED_FIELDS}
