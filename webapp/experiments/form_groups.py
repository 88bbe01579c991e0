"""Sections of the launch form: run, rollouts, optimiser, reward, infrastructure; presets.

The form stays generated from the typed run config (one input per field, its docstring as help).
Where a section comes from, in order:

1. the dataclass field's metadata, ``field(metadata={"group": "optimiser", "advanced": True})``, so
   the config can say it itself (and a reshaped config keeps its sections);
2. otherwise a rule on the field's name (``GROUP_RULES``: patterns, not field lists);
3. otherwise the section "other" (shown open): a new field is never hidden.

Within a section the fields named by ``ESSENTIAL`` patterns (or ``advanced: False``) are shown; the
rest sit in a collapsed "advanced" part. Presets fill fields by name and skip names the form lacks.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

GROUPS: tuple[tuple[str, str], ...] = (
    ("run", "Run"),
    ("rollouts", "Rollouts"),
    ("optimiser", "Optimiser"),
    ("reward", "Reward"),
    ("infrastructure", "Infrastructure"),
    ("other", "Other"),
)
GROUP_RULES: tuple[tuple[str, str], ...] = (
    ("infrastructure", r"(worker|actor|ray_|sandbox|fleet|host)"),
    ("reward", r"(reward|credit|similarity|copy_|guidance)"),
    ("optimiser", r"(^lr$|lr_|_lr|warmup|entropy|kl_|advantage|updates_per)"),
    ("rollouts", r"(group|staleness|probe|turn|token|temperature|rollout|context)"),
    ("run", r"(step|task|seed|checkpoint|budget|name)"),
)
ESSENTIAL = r"^(init_checkpoint|steps|tasks|time_budget_minutes|group_size|groups_per_step|max_turns|lr|warmup_steps|partial_credit|rollout_workers|inference_actors)$"

PRESETS: dict[str, dict] = {
    "smoke test (minutes)": {"steps": 3, "tasks": 4, "group_size": 2, "groups_per_step": 1, "rollout_workers": 2,
                             "max_turns": 4},
    "small run (defaults)": {"steps": 10, "tasks": 16, "group_size": 4, "groups_per_step": 2, "rollout_workers": 4,
                             "max_turns": 4},
    "longer run": {"steps": 100, "tasks": 64, "group_size": 8, "groups_per_step": 4, "rollout_workers": 8,
                   "max_turns": 6, "warmup_steps": 5, "min_lr_ratio": 0.1},
}


def field_group(field: dataclasses.Field) -> tuple[str, bool]:
    """(section key, advanced?) of one config field."""
    meta: Mapping[str, Any] = field.metadata or {}
    group = meta.get("group")
    if group not in dict(GROUPS):
        group = next((key for key, pattern in GROUP_RULES if re.search(pattern, field.name)), "other")
    advanced = meta.get("advanced")
    if advanced is None:
        advanced = group != "other" and not re.match(ESSENTIAL, field.name)
    return group, bool(advanced)


def config_sections(config_class, names: list[str]) -> dict[str, tuple[str, bool]]:
    """{field name: (section, advanced)} for the form's ``names`` (dataclass fields of ``config_class``)."""
    by_name = {item.name: item for item in dataclasses.fields(config_class)}
    return {name: field_group(by_name[name]) if name in by_name else ("other", False) for name in names}


def presets_for(names: list[str]) -> dict[str, dict]:
    """The presets, each limited to fields the form has."""
    return {label: {key: value for key, value in values.items() if key in names} for label, values in PRESETS.items()}
