"""CursorBench-like evaluation: a policy runs the agent loop on a task suite in real sandboxes.

Per task it records how many of its attempts passed the hidden tests, tokens, tool calls and wall
time; the summary has pass@1 and pass@k (the unbiased estimator of Chen et al., 2021) with a 95 %
bootstrap-free Wilson interval on pass@1. Attempts that failed for infrastructure reasons are
excluded from the estimate and counted separately, never scored as failures.

Policies:
- ``scripted``: the reference fix replayed through the same loop and tools (an upper bound that
  checks the suite and the sandbox work);
- ``checkpoint:PATH``: a Flowstate checkpoint served in-process (training.serving.ChatModel);
- ``openai:MODEL@BASE_URL``: any OpenAI-compatible server (key from OPENAI_API_KEY or the config).
"""

from __future__ import annotations

import math
import os
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from training.tasks.base import CodingTask

MAX_SUITE_TASKS = 10_000
VALIDATION_START = MAX_SUITE_TASKS
"""toy-validation-N takes held-out-split tasks from this index on, past the last task any toy-heldout-N can hold:
choosing among checkpoints on it leaves the held-out suite an unbiased test."""
_SUITE_SEEDS = {"train": ("train", 0), "heldout": ("heldout", 0), "validation": ("heldout", VALIDATION_START)}
"""Suite name -> (toy split, first task index) its tasks come from."""
_SUITE = re.compile(rf"^toy-(?P<split>{'|'.join(_SUITE_SEEDS)})-(?P<count>\d+)$")
TASKSET_SUITE = re.compile(r"^taskset-(?P<id>\d{1,18})-(?P<split>train|heldout)$")
"""A mined task set's split (webapp.mining); its tasks come from the database and are passed to run_benchmark."""


class BenchConfigError(ValueError):
    """A benchmark request that cannot run as given; the message says how to fix it."""


@dataclass(frozen=True)
class BenchConfig:
    """What to evaluate, on which suite, how many times."""

    suite: str
    """Task suite: "toy-heldout-N" (held-out toy tasks), "toy-validation-N" (held-out-split tasks that no
    toy-heldout-N contains, for choosing among checkpoints), "toy-train-N", or "taskset-ID-heldout" /
    "taskset-ID-train" (a mined task set's split; the caller passes its tasks to run_benchmark)."""
    policy: str
    """"scripted", "checkpoint:PATH" or "openai:MODEL@BASE_URL"."""
    attempts: int = 1
    """Attempts per task (n); pass@k is reported for k = attempts."""
    max_turns: int = 8
    """Tool-calling turns per attempt."""
    max_tokens_per_turn: int = 256
    """Completion tokens per model call."""
    context_tokens: int = 4096
    """Context budget of the agent loop."""
    temperature: float = 0.7
    """Sampling temperature (attempts of one task differ only through sampling)."""
    wall_time_s: float = 600.0
    """Wall-clock limit of one attempt."""
    concurrency: int = 2
    """Attempts run at the same time."""
    sandbox_backend: str | None = None
    """Sandbox backend (None: the configured default)."""
    api_key: str = ""
    """Key for openai: policies; empty reads OPENAI_API_KEY."""
    exclude_tools: tuple[str, ...] = ()
    """Tools never offered to the policy. This changes the prompt itself (the tool list is part of it),
    so a model trained with the full list may behave differently for that reason alone."""
    disable_tools: tuple[str, ...] = ()
    """Tools offered as usual but refused with an error when called: the prompt stays identical, so
    the comparison isolates what the tool's results add (e.g. ("semantic_search",))."""
    copy_constraint: bool = True
    """checkpoint: policies only: edit_file's old_str can only be copied from the conversation's tool
    results (training.copy_constraint), as the product serves the model; False samples it freely."""

    def __post_init__(self) -> None:
        if not TASKSET_SUITE.match(self.suite):
            suite_tasks_count(self.suite)
        if self.attempts < 1 or self.concurrency < 1 or self.max_turns < 1:
            raise BenchConfigError("attempts, concurrency and max_turns must be >= 1")
        if self.attempts > 1 and self.temperature <= 0:
            raise BenchConfigError("attempts > 1 needs temperature > 0, otherwise every attempt is identical")
        kind = self.policy.split(":", 1)[0]
        if kind not in ("scripted", "checkpoint", "openai"):
            raise BenchConfigError(
                f"policy {self.policy!r} must be 'scripted', 'checkpoint:PATH' or 'openai:MODEL@BASE_URL'"
            )
        if kind == "checkpoint" and not os.path.isdir(self.policy.split(":", 1)[1]):
            raise BenchConfigError(f"{self.policy!r}: the checkpoint directory does not exist")
        if kind == "openai" and "@" not in self.policy:
            raise BenchConfigError(
                "openai policies are written openai:MODEL@BASE_URL, e.g. openai:gpt-4o@https://api.openai.com/v1"
            )

    def check_tools(self) -> None:
        from sandboxes.tools import openai_tool_schemas

        known = {schema["function"]["name"] for schema in openai_tool_schemas()}
        for field_name in ("exclude_tools", "disable_tools"):
            unknown = sorted(set(getattr(self, field_name)) - known)
            if unknown:
                raise BenchConfigError(f"{field_name} names unknown tools {unknown}; known: {sorted(known)}")

    @property
    def policy_kind(self) -> str:
        return self.policy.split(":", 1)[0]


def suite_tasks_count(suite: str) -> tuple[str, int]:
    match = _SUITE.match(suite)
    if not match:
        raise BenchConfigError(
            f"unknown suite {suite!r}; use toy-heldout-N, toy-validation-N or toy-train-N (N tasks), or "
            "taskset-ID-heldout / taskset-ID-train (a mined task set)"
        )
    count = int(match.group("count"))
    if not 1 <= count <= MAX_SUITE_TASKS:
        raise BenchConfigError(f"a suite holds between 1 and {MAX_SUITE_TASKS} tasks")
    return match.group("split"), count


def suite_tasks(suite: str) -> list[CodingTask]:
    from training.tasks.toy import generate_toy_task, toy_task_seeds

    name, count = suite_tasks_count(suite)
    split, start = _SUITE_SEEDS[name]
    return [generate_toy_task(seed) for seed in toy_task_seeds(split=split, count=count, start=start)]


def pass_at_k(*, n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n attempts with c passes: 1 - C(n-c, k) / C(n, k)."""
    if n <= 0 or k > n:
        raise BenchConfigError(f"pass@{k} needs at least {k} valid attempts, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def wilson_interval(successes: float, total: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion."""
    if total == 0:
        return (0.0, 1.0)
    p = successes / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def _scored_task_pairs(before: list[dict], after: list[dict]) -> list[tuple[dict, dict]]:
    """(before row, after row) of every task with a scored attempt in both runs, in ``after``'s order."""
    before_by_task = {row["task_id"]: row for row in before if row["attempts"] > 0}
    return [
        (before_by_task[row["task_id"]], row)
        for row in after
        if row["attempts"] > 0 and row["task_id"] in before_by_task
    ]


def paired_pass_at_1_difference(
    before: list[dict], after: list[dict], z: float = 1.96
) -> tuple[float, float, float, int]:
    """pass@1 after - before on the same tasks, with a 95 % paired interval; tasks are the unit.

    ``before`` and ``after`` are benchmark ``per_task`` rows. Each task scored in both contributes
    d = pass@1_after - pass@1_before, and the interval is mean(d) +- z * sd(d) / sqrt(n). Pairing
    removes the spread of task difficulty, which both evaluations share, from the error of the
    difference; treating the two evaluations as independent samples would count it twice.
    Returns (difference, low, high, tasks compared).
    """
    differences = [
        pass_at_k(n=new["attempts"], c=new["passes"], k=1) - pass_at_k(n=old["attempts"], c=old["passes"], k=1)
        for old, new in _scored_task_pairs(before, after)
    ]
    n = len(differences)
    if n < 2:
        raise BenchConfigError(f"a paired interval needs at least 2 tasks scored in both runs, got {n}")
    mean = statistics.fmean(differences)
    half = z * statistics.stdev(differences) / math.sqrt(n)
    return mean, mean - half, mean + half, n


def paired_task_changes(before: list[dict], after: list[dict], kinds: Mapping[str, str]) -> dict:
    """Where a before/after pass@1 difference comes from, over the tasks scored in both runs.

    ``before`` and ``after`` are benchmark ``per_task`` rows; ``kinds`` maps a task id to its bug kind
    (``CodingTask.mutation_kind``). Counts the tasks whose passes went up, down or stayed, the tasks
    every attempt passed and none did on each side, and per kind the pass@1 before and after and the
    tasks no attempt passed in either run: sharpening turns some-of-k tasks into k-of-k, while a
    task at none-of-k in both is one the policy never learned to solve.
    """
    pairs = _scored_task_pairs(before, after)
    missing = sorted({old["task_id"] for old, _ in pairs} - set(kinds))
    if missing:
        raise BenchConfigError(f"no bug kind for tasks {missing[:3]}: pass the kinds of the suite both runs used")
    changes = {
        "tasks": len(pairs),
        "up": 0, "down": 0, "same": 0,
        "all_passed": [0, 0], "none_passed": [0, 0], "none_passed_in_both": 0,
        "by_kind": {},
    }
    for old, new in pairs:
        rate_before = pass_at_k(n=old["attempts"], c=old["passes"], k=1)
        rate_after = pass_at_k(n=new["attempts"], c=new["passes"], k=1)
        changes["up" if rate_after > rate_before else "down" if rate_after < rate_before else "same"] += 1
        for side, row in enumerate((old, new)):
            changes["all_passed"][side] += row["passes"] == row["attempts"]
            changes["none_passed"][side] += row["passes"] == 0
        never = old["passes"] == 0 and new["passes"] == 0
        changes["none_passed_in_both"] += never
        kind = changes["by_kind"].setdefault(
            kinds[old["task_id"]], {"tasks": 0, "pass_at_1": [0.0, 0.0], "none_passed_in_both": 0}
        )
        kind["tasks"] += 1
        kind["pass_at_1"][0] += rate_before
        kind["pass_at_1"][1] += rate_after
        kind["none_passed_in_both"] += never
    for kind in changes["by_kind"].values():
        kind["pass_at_1"] = [total / kind["tasks"] for total in kind["pass_at_1"]]
    changes["by_kind"] = dict(sorted(changes["by_kind"].items(), key=lambda item: (-item[1]["tasks"], item[0])))
    return changes


@dataclass
class TaskOutcome:
    """All attempts of one task."""

    task_id: str
    attempts: int = 0
    passes: int = 0
    infrastructure_failures: int = 0
    tokens: list[int] = field(default_factory=list)
    tool_calls: list[int] = field(default_factory=list)
    calls_by_tool: Counter = field(default_factory=Counter)
    failed_calls_by_tool: Counter = field(default_factory=Counter)
    """Calls whose result was an error: a rejected edit, a refused or disabled call, a non-zero exit."""
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        return {
            "task_id": self.task_id,
            "attempts": self.attempts,
            "passes": self.passes,
            "infrastructure_failures": self.infrastructure_failures,
            "mean_tokens": sum(self.tokens) / len(self.tokens) if self.tokens else 0.0,
            "mean_tool_calls": sum(self.tool_calls) / len(self.tool_calls) if self.tool_calls else 0.0,
            "wall_s": self.wall_s,
        }


class ToolSubsetPolicy:
    """Offers the wrapped policy every tool except the excluded ones."""

    def __init__(self, policy, excluded: tuple[str, ...]) -> None:
        self.policy = policy
        self.excluded = set(excluded)
        self.name = getattr(policy, "name", "policy")

    def complete(self, *, tools, **kwargs):
        offered = [tool for tool in tools or [] if tool["function"]["name"] not in self.excluded]
        return self.policy.complete(tools=offered, **kwargs)


def _policy_factory(config: BenchConfig) -> tuple[Callable[[CodingTask, int], object], Callable[[], None]]:
    """(make_policy(task, attempt), close)."""
    kind = config.policy_kind
    if kind == "scripted":
        from training.train.scripted_expert import toy_expert_policy

        return (lambda task, attempt: toy_expert_policy(task)), (lambda: None)
    if kind == "checkpoint":
        from training.serving import ChatModel
        from training.train.rollouts import LocalModelPolicy

        chat_model = ChatModel.load(config.policy.split(":", 1)[1], copy_constraint=config.copy_constraint)
        return (
            lambda task, attempt: LocalModelPolicy(chat_model, seed=1000 * attempt + len(task.task_id))
        ), (chat_model.close)
    from training.agent.policy import OpenAIChatPolicy

    model, base_url = config.policy.split(":", 1)[1].rsplit("@", 1)
    key = config.api_key or os.environ.get("OPENAI_API_KEY", "")
    return (
        lambda task, attempt: OpenAIChatPolicy(base_url=base_url, model=model, api_key=key, seed=attempt)
    ), (lambda: None)


def _attempt_record(outcome: TaskOutcome, *, result, passed: bool) -> None:
    """Count one scored attempt of a task: pass, tokens, tool calls and the failed ones by tool."""
    outcome.attempts += 1
    outcome.passes += int(passed)
    outcome.tokens.append(result.completion_tokens)
    calls = [event["payload"]["name"] for event in result.events if event["kind"] == "tool_call"]
    outcome.tool_calls.append(len(calls))
    outcome.calls_by_tool.update(calls)
    outcome.failed_calls_by_tool.update(
        event["payload"]["name"]
        for event in result.events
        if event["kind"] == "tool_result" and not event["payload"]["ok"]
    )


def run_benchmark(
    *, config: BenchConfig, on_task: Callable[[dict], None] | None = None, tasks: list[CodingTask] | None = None
) -> dict:
    """Evaluate the policy on every task of the suite (or on ``tasks``, which a task-set suite needs);
    returns the summary (per-task rows included)."""
    from sandboxes import get_backend
    from sandboxes.base import SandboxError
    from training.agent.config import AgentLimits
    from training.agent.loop import run_agent
    from training.tasks.reward import RewardInfrastructureError, score_rollout
    from training.tasks.sandboxing import task_sandboxes_create

    if tasks is None:
        if TASKSET_SUITE.match(config.suite):
            raise BenchConfigError(f"{config.suite} is a mined task set: load its tasks (webapp.mining) and pass them")
        tasks = suite_tasks(config.suite)
    backend = get_backend(config.sandbox_backend)
    limits = AgentLimits(
        max_turns=config.max_turns,
        max_tokens=config.max_turns * config.max_tokens_per_turn * 2,
        max_tokens_per_turn=config.max_tokens_per_turn,
        wall_time_s=config.wall_time_s,
        context_tokens=config.context_tokens,
        temperature=config.temperature,
        top_p=1.0,
    )
    config.check_tools()
    make_base_policy, close = _policy_factory(config)

    def make_policy(task: CodingTask, attempt_index: int):
        policy = make_base_policy(task, attempt_index)
        return ToolSubsetPolicy(policy, config.exclude_tools) if config.exclude_tools else policy

    outcomes = {task.task_id: TaskOutcome(task_id=task.task_id) for task in tasks}
    started = time.monotonic()

    def attempt(job: tuple[CodingTask, int]) -> None:
        task, index = job
        outcome = outcomes[task.task_id]
        attempt_started = time.monotonic()
        try:
            (sandbox,) = task_sandboxes_create(backend=backend, task=task)
        except (SandboxError, OSError):
            outcome.infrastructure_failures += 1
            return
        try:
            result = run_agent(
                sandbox=sandbox, policy=make_policy(task, index), prompt=task.prompt, limits=limits,
                disabled_tools=config.disable_tools,
            )
            if result.infrastructure_error:
                outcome.infrastructure_failures += 1
                return
            reward = score_rollout(sandbox=sandbox, task=task)
        except (RewardInfrastructureError, SandboxError, OSError):
            outcome.infrastructure_failures += 1
            return
        finally:
            sandbox.destroy()
            outcome.wall_s += time.monotonic() - attempt_started
        _attempt_record(outcome, result=result, passed=reward.passed)

    jobs = [(task, index) for task in tasks for index in range(config.attempts)]
    try:
        with ThreadPoolExecutor(max_workers=config.concurrency) as pool:
            for _ in pool.map(attempt, jobs):
                pass
    finally:
        close()
    rows = [outcomes[task.task_id].as_dict() for task in tasks]
    if on_task is not None:
        for row in rows:
            on_task(row)
    return _summary(config=config, tasks=tasks, outcomes=outcomes, rows=rows, wall_s=time.monotonic() - started)


def _summary(
    *, config: BenchConfig, tasks: list[CodingTask], outcomes: dict[str, TaskOutcome], rows: list[dict], wall_s: float
) -> dict:
    """run_benchmark's summary: pass@1 (with its 95 % interval) and pass@k over the scored tasks, tokens, tool calls."""
    scored = [outcomes[task.task_id] for task in tasks if outcomes[task.task_id].attempts > 0]
    k = config.attempts
    pass1 = [pass_at_k(n=o.attempts, c=o.passes, k=1) for o in scored]
    passk = [pass_at_k(n=o.attempts, c=o.passes, k=k) for o in scored if o.attempts >= k]
    low, high = wilson_interval(sum(pass1), len(pass1))
    all_tokens = [t for o in scored for t in o.tokens]
    all_calls = [c for o in scored for c in o.tool_calls]
    return {
        "config": asdict(config) | {"api_key": ""},
        "tasks": len(tasks),
        "scored_tasks": len(scored),
        "infrastructure_failures": sum(o.infrastructure_failures for o in outcomes.values()),
        "pass_at_1": sum(pass1) / len(pass1) if pass1 else None,
        "pass_at_1_ci95": [low, high],
        "pass_at_k": sum(passk) / len(passk) if passk else None,
        "k": k,
        "mean_tokens": sum(all_tokens) / len(all_tokens) if all_tokens else 0.0,
        "mean_tool_calls": sum(all_calls) / len(all_calls) if all_calls else 0.0,
        "calls_by_tool": dict(sum((o.calls_by_tool for o in scored), Counter())),
        "failed_calls_by_tool": dict(sum((o.failed_calls_by_tool for o in scored), Counter())),
        "wall_s": wall_s,
        "per_task": rows,
    }


