"""Mining validated bug-fixing tasks from a registered repository's prepared environment.

Candidates come from (a) mutations of the repository's own code (training.tasks.mutations) and (b)
its git history: a commit that changed exactly one code file and some tests is reverted in that code
file at HEAD, keeping HEAD's tests (SWE-smith / SWE-gym style). Every candidate runs the recipe's
test command in a sandbox forked from the prepared snapshot (training.tasks.environment) and is
kept only when it validates:

- fail-to-pass: some tests that pass on the clean repository fail with the bug;
- pass-to-pass: every other baseline-passing test still runs and passes (a bug that stops tests
  from being collected is rejected);
- new: not the same buggy file, nor the same failing tests at the same line, as a kept task;
- not revealed: the visible files hold no VCS metadata or patch files, and no other file carries
  the fixed file's text (the agent must not be able to revert a visible diff).

The bug report is written from the failing tests' output (test names, the first error line) and
never names the fixed text. The train / held-out split is by file (by function when the repository
has one source file with tasks), so held-out code is never trained on.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from training.tasks.base import CodingTask, TaskError, minimal_fix_edit
from training.tasks.environment import PreparedEnvironment, baseline_limits
from training.tasks.mutations import MUTATION_KINDS, MutationError, enumerate_mutations
from training.tasks.testoutput import parse_test_output, passing_tests
from training.tasks.testselect import CallMap, call_map_build, selected_command

TEST_PATH = re.compile(r"(^|/)(tests?/|testing/|test_[^/]*\.py$|[^/]*_test\.py$|conftest\.py$)")
_SKIPPED_PATH = re.compile(r"(^|/)(\.git|\.flowstate|\.tox|\.nox|build|dist|docs?|examples?|benchmarks?)/|"
                           r"(^|/)(setup\.py|noxfile\.py|__main__\.py)$")
_REVEALING = re.compile(r"\.(orig|rej|patch|diff)$")
MAX_FILE_BYTES = 200_000
MAX_REPOSITORY_BYTES = 8_000_000
SELECTIONS = ("calls", "calls+full", "full")


class MiningError(ValueError):
    """The repository cannot be mined as asked; the message says why."""


@dataclass(frozen=True)
class MiningConfig:
    """How many candidates to try and how to keep and split them."""

    max_candidates: int = 200
    """Candidates validated in all (each costs one run of the test suite)."""
    max_tasks: int = 100
    """Stop once this many tasks are validated."""
    history_commits: int = 100
    """Newest commits of the git history examined for code+test changes (0: mutations only)."""
    kinds: tuple[str, ...] = MUTATION_KINDS
    """Mutation operators used (training.tasks.mutations.MUTATION_KINDS)."""
    seed: int = 0
    """Seeds the order in which mutation candidates are tried."""
    test_timeout_s: float = 0.0
    """Limit of one candidate's test run; 0 derives it from the baseline (5x its duration + 10 s)."""
    time_budget_s: float = 1800.0
    """Wall-clock budget of the whole mining run; candidates not started by then are not tried."""
    heldout_percent: int = 25
    """Share of files (or functions) whose tasks form the held-out split."""
    workers: int = 1
    """Candidates validated at the same time (each in its own sandbox)."""
    expert_check: bool = True
    """Run the scripted expert on every kept task and record its solve rate (difficulty estimate)."""
    selection: str = "calls"
    """Tests a candidate runs: "calls" (only the tests that call the mutated function, from a call map of
    the baseline, training.tasks.testselect), "calls+full" (those first, then the whole suite for a
    candidate that fails there), or "full" (the whole suite for every candidate)."""

    def __post_init__(self) -> None:
        if self.max_candidates < 1 or self.max_tasks < 1 or self.workers < 1 or self.history_commits < 0:
            raise MiningError("max_candidates, max_tasks and workers must be >= 1; history_commits >= 0")
        if not 0 <= self.heldout_percent <= 90:
            raise MiningError("heldout_percent must be between 0 and 90")
        if self.time_budget_s <= 0 or self.test_timeout_s < 0:
            raise MiningError("time_budget_s must be > 0 and test_timeout_s >= 0")
        unknown = set(self.kinds) - set(MUTATION_KINDS)
        if unknown or not self.kinds:
            raise MiningError(f"kinds must be a non-empty subset of {MUTATION_KINDS}")
        if self.selection not in SELECTIONS:
            raise MiningError(f"selection must be one of {SELECTIONS}")


@dataclass(frozen=True)
class Candidate:
    """One proposed bug: the buggy text of one file at HEAD."""

    source: str
    """"mutation" or "history"."""
    path: str
    """The file with the bug."""
    buggy: str
    """Its text with the bug."""
    kind: str
    """Mutation kind, or "revert"."""
    description: str
    """What changed (never shown to the agent)."""
    function: str = ""
    """Function the mutation is in (mutations only)."""
    line: int = 0
    """First changed line."""
    commit: str = ""
    """The commit whose code change was reverted (history only)."""


@dataclass
class MiningResult:
    """Kept tasks, rejection counts and the figures of the run."""

    tasks: list[CodingTask] = field(default_factory=list)
    rejected: Counter = field(default_factory=Counter)
    tried: int = 0
    proposed: dict = field(default_factory=dict)
    wall_s: float = 0.0
    validation_s: float = 0.0
    expert_s: float = 0.0
    stopped: str = ""
    runs: Counter = field(default_factory=Counter)
    """Test runs by kind: "full", "selected" (only the calling tests), "none" (no test calls the function)."""
    selection_note: str = ""
    """How tests were selected (the call map's figures, or why every candidate ran the whole suite)."""


def repository_text_files(*, sandbox, paths: list[str]) -> dict[str, str]:
    """The repository's text files (read through the sandbox), without VCS and setup directories."""
    files: dict[str, str] = {}
    total = 0
    for path in paths:
        if path.startswith((".git/", ".flowstate/")) or "/.git/" in path or "__pycache__/" in path:
            continue
        data = sandbox.read_bytes(path)
        if len(data) > MAX_FILE_BYTES or b"\0" in data[:4096]:
            continue
        try:
            files[path] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        total += len(data)
        if total > MAX_REPOSITORY_BYTES:
            raise MiningError(f"the repository's text files exceed {MAX_REPOSITORY_BYTES // 1_000_000} MB; "
                              "tasks carry the whole repository, so mine a smaller one")
    return files


def source_files(files: dict[str, str]) -> list[str]:
    """Python files that hold code (not tests, setup scripts, docs or examples)."""
    return sorted(p for p in files if p.endswith(".py") and not TEST_PATH.search(p) and not _SKIPPED_PATH.search(p))


def mutation_candidates(files: dict[str, str], *, config: MiningConfig) -> list[Candidate]:
    """Every mutation of every source file, shuffled per file and interleaved across files."""
    rng = random.Random(config.seed)
    per_file: list[list[Candidate]] = []
    for path in source_files(files):
        try:
            mutations = enumerate_mutations(files[path], path=path, kinds=config.kinds)
        except MutationError:
            continue
        rng.shuffle(mutations)
        per_file.append([Candidate(source="mutation", path=path, buggy=m.mutated_source, kind=m.kind,
                                   description=m.description, function=m.function, line=m.lineno)
                         for m in mutations])
    rng.shuffle(per_file)
    interleaved: list[Candidate] = []
    for index in range(max((len(c) for c in per_file), default=0)):
        interleaved.extend(c[index] for c in per_file if index < len(c))
    return interleaved


_GIT = "git -c safe.directory='*' -c core.hooksPath=/dev/null"


def history_candidates(*, sandbox, files: dict[str, str], commits: int) -> list[Candidate]:
    """HEAD with one commit's code change reverted, for commits that changed one code file and tests."""
    if commits == 0 or sandbox.exec(f"{_GIT} rev-parse --verify -q HEAD", timeout_s=30).exit_code != 0:
        return []
    log = sandbox.exec(f"{_GIT} log --no-merges --format='@%H %P' --name-only -n {int(commits)} HEAD", timeout_s=60)
    code = set(source_files(files))
    candidates: list[Candidate] = []
    for block in log.stdout.split("@")[1:]:
        lines = [line.strip() for line in block.strip().splitlines() if line.strip()]
        shas, changed = lines[0].split(), lines[1:]
        if len(shas) != 2 or not re.fullmatch(r"[0-9a-f]{40}", shas[0] + shas[1][:0]):
            continue
        commit, parent = shas
        changed_code = [p for p in changed if p.endswith(".py") and not TEST_PATH.search(p)]
        if len(changed_code) != 1 or not any(TEST_PATH.search(p) for p in changed) or changed_code[0] not in code:
            continue
        path = changed_code[0]
        revert = sandbox.exec(
            f"{_GIT} diff {parent} {commit} -- '{path}' > /tmp/revert.patch && {_GIT} apply -R /tmp/revert.patch",
            timeout_s=60,
        )
        if revert.exit_code != 0:
            continue  # the change does not revert cleanly at HEAD
        buggy = sandbox.read_bytes(path).decode("utf-8", errors="replace")
        sandbox.exec(f"{_GIT} checkout -q -- '{path}'", timeout_s=60)
        if buggy != files[path]:
            candidates.append(Candidate(source="history", path=path, buggy=buggy, kind="revert",
                                        description=f"the code change of commit {commit[:12]} reverted",
                                        commit=commit))
    return candidates


def split_units(candidates: list[Candidate], heldout_percent: int) -> tuple[bool, dict[str, str]]:
    """(by file?, unit -> "train"/"heldout"); units are files, or functions when one file has candidates."""
    by_file = len({c.path for c in candidates}) >= 2
    sizes = Counter(_unit(c, by_file) for c in candidates)
    units = sorted(sizes, key=lambda u: hashlib.sha256(u.encode()).hexdigest())
    # Units in hash order join the held-out split until it holds heldout_percent of the candidates, so a
    # unit with many mutation sites does not tilt the share; the last unit always stays in train.
    split, held = {}, 0
    target = math.ceil(sum(sizes.values()) * heldout_percent / 100)
    for index, unit in enumerate(units):
        heldout = held < target and index < len(units) - 1
        split[unit] = "heldout" if heldout else "train"
        held += sizes[unit] if heldout else 0
    return by_file, split


def _unit(candidate: Candidate, by_file: bool) -> str:
    return candidate.path if by_file else f"{candidate.path}::{candidate.function or candidate.commit[:12]}"


_ERROR_LINE = re.compile(r"^(E\s+)?(\w+(Error|Exception)|AssertionError|assert )\b.*", re.M)


def bug_report(*, repo_label: str, command: str, output: str, failing: list[str], hidden: tuple[str, ...]) -> str:
    """An issue written from the failing tests' output; lines that contain fixed text are left out."""
    message = ""
    for match in _ERROR_LINE.finditer(output):
        line = match.group(0).removeprefix("E").strip()
        if line and not any(text and text in line for text in hidden):
            message = line[:300]
            break
    shown = ", ".join(f"`{name}`" for name in failing[:3])
    more = f" and {len(failing) - 3} more" if len(failing) > 3 else ""
    detail = f"\n\nThe first failure reports: `{message}`" if message else ""
    return (f"Tests of `{repo_label}` fail: {shown}{more} no longer pass when running `{command}`.{detail}\n\n"
            "Find the bug in the code and fix it. Do not modify the tests.")


def _fixed_text_lines(fixed: str, buggy: str) -> tuple[str, ...]:
    removed = set(fixed.splitlines()) - set(buggy.splitlines())
    return tuple(line.strip() for line in removed if len(line.strip()) >= 6)


@dataclass
class _Context:
    prepared: PreparedEnvironment
    files: dict[str, str]
    backend: object
    config: MiningConfig
    repo_label: str
    timeout_s: float
    split: dict[str, str]
    by_file: bool
    lock: threading.Lock = field(default_factory=threading.Lock)
    seen: set = field(default_factory=set)
    callmap: CallMap | None = None
    runs: Counter = field(default_factory=Counter)


def _revealed(files: dict[str, str], path: str, fixed: str) -> bool:
    if any(_REVEALING.search(p) for p in files):
        return True
    return any(text == fixed for other, text in files.items() if other != path)


def _tests_run(candidate: Candidate, ctx: _Context) -> tuple[object, set[str]] | str:
    """(result, tests whose outcome it reports) of the candidate's test run, or why it needs none."""
    recipe = ctx.prepared.recipe
    baseline = set(recipe.baseline.get("passed") or ())
    selected = None
    if ctx.callmap is not None and candidate.source == "mutation":
        selected = ctx.callmap.selection(path=candidate.path, function=candidate.function)
        if selected is not None and not selected & baseline:
            with ctx.lock:
                ctx.runs["none"] += 1
            return "no test calls the mutated function (not fail-to-pass)"
    command = selected_command(recipe, selected & baseline, ctx.callmap) if selected is not None else None
    sandbox = ctx.backend.sandbox_create(snapshot=ctx.prepared.snapshot, limits=baseline_limits(ctx.timeout_s))
    try:
        sandbox.write_bytes(candidate.path, candidate.buggy.encode())
        if command is not None:
            result = sandbox.exec(command, timeout_s=ctx.timeout_s)
            statuses, _ = parse_test_output(result.stdout + "\n" + result.stderr, recipe.runner)
            expected = selected & baseline
            full = result.timed_out or bool(expected - set(statuses))  # unsure: ask the whole suite
            full = full or (ctx.config.selection == "calls+full" and bool(expected - passing_tests(statuses)))
            with ctx.lock:
                ctx.runs["selected"] += 1
            if not full:
                return result, expected
        result = sandbox.exec(recipe.test_command, timeout_s=ctx.timeout_s)
        with ctx.lock:
            ctx.runs["full"] += 1
        return result, baseline
    finally:
        sandbox.destroy()


def candidate_validate(candidate: Candidate, ctx: _Context) -> CodingTask | str:
    """The validated task, or the reason the candidate is rejected."""
    recipe = ctx.prepared.recipe
    fixed = ctx.files[candidate.path]
    if _revealed(ctx.files, candidate.path, fixed):
        return "the fix is visible in the repository"
    ran = _tests_run(candidate, ctx)
    if isinstance(ran, str):
        return ran
    result, expected = ran
    if result.timed_out:
        return "the tests hang with the bug"
    output = result.stdout + "\n" + result.stderr
    statuses, _ = parse_test_output(output, recipe.runner)
    baseline = set(recipe.baseline.get("passed") or ())
    if expected - set(statuses):
        return "baseline tests no longer run (collection or import error)"
    failing = sorted(expected - passing_tests(statuses))
    if not failing:
        return "no test fails with the bug (not fail-to-pass)"
    if len(failing) == len(baseline) and len(baseline) > 3:
        return "every test fails (the bug breaks the whole suite)"
    duplicate_key = (candidate.path, candidate.line, tuple(failing))
    fingerprint = hashlib.sha256(f"{candidate.path}\0{candidate.buggy}".encode()).hexdigest()[:16]
    with ctx.lock:
        if fingerprint in ctx.seen or (candidate.source == "mutation" and duplicate_key in ctx.seen):
            return "duplicate of a kept task"
        ctx.seen.update({fingerprint, duplicate_key})
    try:
        solution = minimal_fix_edit(path=candidate.path, buggy=candidate.buggy, fixed=fixed)
    except TaskError as error:
        return f"no unique fix edit: {error}"
    hidden = {p: t for p, t in ctx.files.items() if TEST_PATH.search(p)}
    report = bug_report(repo_label=ctx.repo_label, command=recipe.test_command, output=output, failing=failing,
                        hidden=_fixed_text_lines(fixed, candidate.buggy))
    return CodingTask(
        task_id=f"repo-{ctx.repo_label}-{fingerprint}", tier="repo",
        split=ctx.split[_unit(candidate, ctx.by_file)], prompt=report,
        files={**ctx.files, candidate.path: candidate.buggy}, hidden_tests=hidden,
        test_command=recipe.test_command, fail_to_pass=tuple(failing),
        pass_to_pass=tuple(sorted(baseline - set(failing))), solution=solution, mutation_kind=candidate.kind,
        mutation_description=candidate.description,
        metadata={"source": candidate.source, "path": candidate.path, "function": candidate.function,
                  "line": candidate.line, "commit": candidate.commit, "repository": ctx.repo_label},
        test_timeout_s=ctx.timeout_s, setup_commands=recipe.setup_commands, setup_network=recipe.network,
    )


def expert_solves(*, backend, prepared: PreparedEnvironment, task: CodingTask) -> bool:
    """Whether the scripted expert's tool calls fix the task in a sandbox of the prepared environment."""
    from training.agent.config import AgentLimits
    from training.agent.loop import run_agent
    from training.tasks.reward import score_rollout
    from training.train.scripted_expert import toy_expert_policy

    sandbox = backend.sandbox_create(snapshot=prepared.snapshot, limits=baseline_limits(task.test_timeout_s))
    try:
        sandbox.write_bytes(task.solution.path, task.files[task.solution.path].encode())
        result = run_agent(sandbox=sandbox, policy=toy_expert_policy(task), prompt=task.prompt,
                           limits=AgentLimits(max_turns=6, wall_time_s=task.test_timeout_s * 3 + 60))
        return not result.infrastructure_error and score_rollout(sandbox=sandbox, task=task).passed
    finally:
        sandbox.destroy()


def mine_repository_tasks(
    *, backend, prepared: PreparedEnvironment, config: MiningConfig, repo_label: str,
    on_progress: Callable[[dict], None] | None = None, should_stop: Callable[[], bool] | None = None,
) -> MiningResult:
    """Propose, validate, split and rate tasks from a prepared repository environment."""
    started = time.monotonic()
    result = MiningResult()
    sandbox = backend.sandbox_create(snapshot=prepared.snapshot, limits=baseline_limits(120))
    try:
        files = repository_text_files(sandbox=sandbox, paths=prepared.paths)
        history = history_candidates(sandbox=sandbox, files=files, commits=config.history_commits)
    finally:
        sandbox.destroy()
    mutations = mutation_candidates(files, config=config)
    if not history and not mutations:
        raise MiningError("no candidate bugs: the repository has no mutable Python code outside its tests")
    candidates = (history + mutations)[: config.max_candidates]
    result.proposed = {"history": len(history), "mutation": len(mutations)}
    by_file, split = split_units(candidates, config.heldout_percent)
    baseline_s = float(prepared.recipe.baseline.get("duration_s") or 10.0)
    ctx = _Context(prepared=prepared, files=files, backend=backend, config=config, repo_label=repo_label,
                   timeout_s=config.test_timeout_s or baseline_s * 5 + 10, split=split, by_file=by_file)
    if config.selection != "full" and mutations:
        # The mapping run profiles every call, so it gets more time than a candidate's run.
        ctx.callmap, result.selection_note = call_map_build(backend=backend, prepared=prepared,
                                                            timeout_s=ctx.timeout_s * 3)
    _report(on_progress, result, phase="validating")
    _validate_all(candidates, ctx, result, started, on_progress, should_stop)
    result.runs = ctx.runs
    result.validation_s = time.monotonic() - started
    if config.expert_check:
        expert_started = time.monotonic()
        for task in result.tasks:
            if should_stop is not None and should_stop():
                break
            task.metadata["expert_solved"] = expert_solves(backend=backend, prepared=prepared, task=task)
            _report(on_progress, result, phase="rating")
        result.expert_s = time.monotonic() - expert_started
    result.wall_s = time.monotonic() - started
    return result


def _report(on_progress, result: MiningResult, *, phase: str) -> None:
    if on_progress is not None:
        on_progress({"phase": phase, "tried": result.tried, "validated": len(result.tasks),
                     "rejected": dict(result.rejected), "proposed": result.proposed})


def _validate_all(candidates, ctx: _Context, result: MiningResult, started: float, on_progress, should_stop) -> None:
    lock = threading.Lock()

    def run(candidate: Candidate) -> None:
        with lock:
            if len(result.tasks) >= ctx.config.max_tasks:
                result.stopped = result.stopped or "max_tasks"
                return
            if time.monotonic() - started > ctx.config.time_budget_s:
                result.stopped = result.stopped or "time budget"
                return
            if should_stop is not None and should_stop():
                result.stopped = result.stopped or "cancelled"
                return
        outcome = candidate_validate(candidate, ctx)
        with lock:
            result.tried += 1
            if isinstance(outcome, CodingTask):
                if len(result.tasks) < ctx.config.max_tasks:
                    result.tasks.append(outcome)
            else:
                result.rejected[outcome] += 1
            _report(on_progress, result, phase="validating")

    with ThreadPoolExecutor(max_workers=ctx.config.workers) as pool:
        list(pool.map(run, candidates))
