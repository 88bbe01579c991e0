"""A registered repository's environment: detect, set up (network on for this phase only), baseline.

``environment_prepare`` is the one path from a repository source to a prepared snapshot: it detects
the recipe (training.tasks.autoinstall.detect_recipe) unless one is given (a recipe the user edited),
builds the snapshot with its setup commands under the budget's limits (network, time, disk), and runs
the test suite once in a sandbox without network to record the baseline: which tests pass, fail or
error on the clean repository, and how long the suite takes. Each step is logged; a failure names
the step ("detect", "install", "test") and keeps the log. Mining (training.tasks.repo_mining) and
product verification (webapp.agents.verify) reuse the recipe; mining forks the prepared snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from training.tasks.autoinstall import (
    InstallError,
    InstallFailure,
    InstallRecipe,
    SetupBudget,
    detect_recipe,
    repository_files,
)
from training.tasks.testoutput import parse_test_output

if TYPE_CHECKING:
    from sandboxes.base import Snapshot

LOG_MAX_CHARS = 64_000


@dataclass
class PreparedEnvironment:
    """A verified recipe and the snapshot it built (dependencies installed, frozen)."""

    recipe: InstallRecipe
    """The recipe, with tests_ran / tests_passed / baseline filled in and verified=True."""
    snapshot: Snapshot
    """The backend's Snapshot with the setup done; sandboxes forked from it start ready to test."""
    paths: list[str]
    """Every file of the repository (relative paths, .git excluded)."""
    log: str
    """Each setup step and the baseline run, with their outputs (bounded)."""


class _Log:
    def __init__(self, on_change: Callable[[str, str], None] | None = None) -> None:
        self.parts: list[str] = []
        self.current = ""
        self.on_change = on_change

    def add(self, text: str) -> None:
        self.parts.append(text.rstrip() + "\n")
        self._notify()

    def step(self, label: str) -> None:
        """The step that starts now, in words (a page showing the setup live names it)."""
        self.current = label
        self._notify()

    def _notify(self) -> None:
        if self.on_change is not None:
            self.on_change(self.text(), self.current)

    def text(self) -> str:
        joined = "".join(self.parts)
        return joined if len(joined) <= LOG_MAX_CHARS else "[earlier log dropped]\n" + joined[-LOG_MAX_CHARS:]


def setup_limits(budget: SetupBudget):
    from sandboxes.base import SandboxLimits

    return SandboxLimits(
        cpu_seconds=max(60, int(budget.setup_timeout_s * 2)), memory_mb=2048, max_processes=128,
        disk_mb=budget.setup_disk_mb, command_timeout_s=budget.setup_timeout_s,
        lifetime_s=budget.setup_timeout_s * 4 + 60, network=budget.network,
    )


def baseline_limits(test_timeout_s: float):
    """Limits of a sandbox that runs the repository's suite (no network, generous CPU for slow suites)."""
    from sandboxes.base import SandboxLimits

    return SandboxLimits(
        cpu_seconds=max(120, int(test_timeout_s * 2)), memory_mb=2048, max_processes=128, disk_mb=512,
        command_timeout_s=test_timeout_s, lifetime_s=test_timeout_s * 3 + 120,
    )


def baseline_run(*, sandbox, recipe: InstallRecipe, timeout_s: float) -> dict:
    """Run the suite once; {passed, failed, errored, ran, duration_s, timed_out, exit_code, output_tail}."""
    started = time.monotonic()
    result = sandbox.exec(recipe.test_command, timeout_s=timeout_s)
    duration = time.monotonic() - started
    output = result.stdout + "\n" + result.stderr
    statuses, ran = parse_test_output(output, recipe.runner)
    return {
        "passed": sorted(t for t, s in statuses.items() if s in ("ok", "expected failure")),
        "failed": sorted(t for t, s in statuses.items() if s in ("FAIL", "unexpected success")),
        "errored": sorted(t for t, s in statuses.items() if s == "ERROR"),
        "skipped": sum(1 for s in statuses.values() if s == "skipped"),
        "ran": ran or 0, "duration_s": round(duration, 3), "timed_out": result.timed_out,
        "exit_code": result.exit_code, "output_tail": output[-4000:],
    }


def _detect(*, backend, source, network: bool, log: _Log) -> tuple[InstallRecipe, list[str]] | InstallFailure:
    from sandboxes.base import SandboxError, SnapshotError
    from training.tasks.sandboxing import DEFAULT_TASK_LIMITS

    try:
        plain = backend.snapshot_create(source=source)
    except (SnapshotError, OSError) as error:
        log.add(f"$ fetch {source.kind} {source.location}\n{error}")
        return InstallFailure(stage="detect", reason=f"the repository could not be fetched: {error}", log=log.text())
    sandbox = backend.sandbox_create(snapshot=plain, limits=DEFAULT_TASK_LIMITS)
    try:
        files, paths = repository_files(sandbox)
    except SandboxError as error:
        return InstallFailure(stage="detect", reason=f"could not read the repository: {error}", log=log.text())
    finally:
        sandbox.destroy()
        _delete(backend, plain)
    log.add(f"detect: {len(paths)} files; configuration: {', '.join(sorted(files)) or 'none'}")
    try:
        return detect_recipe(files, paths, network=network), paths
    except InstallError as error:
        log.add(f"detect failed: {error}")
        return InstallFailure(stage="detect", reason=str(error), log=log.text())


def _delete(backend, snapshot) -> None:
    delete = getattr(backend, "snapshot_delete", None)
    if delete is not None:
        delete(snapshot=snapshot)


def environment_prepare(
    *, backend, source, budget: SetupBudget | None = None, recipe: InstallRecipe | None = None,
    on_log: Callable[[str, str], None] | None = None,
) -> PreparedEnvironment | InstallFailure:
    """Detect (or take ``recipe``), set up under ``budget`` and run the baseline; the environment or why not.

    ``on_log(log so far, current step)`` is called as each step starts and as each entry is logged."""
    from sandboxes.base import BackendUnavailable, SandboxError, SnapshotError

    budget = budget or SetupBudget()
    log = _Log(on_log)
    paths: list[str] = []
    if recipe is None:
        log.step("fetching the repository and detecting its recipe")
        detected = _detect(backend=backend, source=source, network=budget.network, log=log)
        if isinstance(detected, InstallFailure):
            return detected
        recipe, paths = detected
    else:
        recipe = replace(recipe, network=budget.network, verified=False, baseline={})
        log.add("recipe: given (edited), detection skipped")
    log.add("setup (network " + ("on" if budget.network else "off") + f", {budget.setup_timeout_s:.0f}s per command, "
            f"{budget.setup_disk_mb} MB disk):\n" + "\n".join(f"$ {c}" for c in recipe.setup_commands))
    started = time.monotonic()
    log.step("running the setup commands")
    try:
        snapshot = backend.snapshot_create(source=source, setup_commands=recipe.setup_commands,
                                           setup_limits=setup_limits(budget))
    except (SnapshotError, BackendUnavailable) as error:
        log.add(f"setup failed after {time.monotonic() - started:.1f}s:\n{error}")
        over = "timed out" in str(error) or "No space left" in str(error) or "Disk quota" in str(error)
        if over:
            reason = "the setup exceeded its budget (time or disk); raise the budget or trim the requirements"
        elif budget.network:
            reason = "a setup command failed (see the log)"
        else:
            reason = ("installing offline failed (sandboxes have no network: every dependency must already be "
                      "in the sandbox image, or turn the setup network on)")
        return InstallFailure(stage="install", reason=reason, output_tail=str(error)[-2000:], log=log.text())
    log.add(f"setup done in {time.monotonic() - started:.1f}s")
    log.step("running the test suite on the clean repository")
    sandbox = backend.sandbox_create(snapshot=snapshot, limits=baseline_limits(budget.test_timeout_s))
    try:
        if not paths:
            paths = repository_files(sandbox)[1]
        baseline = baseline_run(sandbox=sandbox, recipe=recipe, timeout_s=budget.test_timeout_s)
    except SandboxError as error:
        return InstallFailure(stage="test", reason=f"the sandbox failed while testing: {error}", log=log.text())
    finally:
        sandbox.destroy()
    log.add(f"$ {recipe.test_command}\n(exit {baseline['exit_code']}, {baseline['duration_s']}s)\n"
            f"{baseline['output_tail']}")
    tail = baseline["output_tail"][-2000:]
    if baseline["timed_out"]:
        return InstallFailure(stage="test", reason=f"the test suite ran past {budget.test_timeout_s:.0f}s (it hangs, "
                              "or needs a larger test timeout)", output_tail=tail, log=log.text())
    if recipe.runner == "pytest" and "No module named pytest" in baseline["output_tail"]:
        return InstallFailure(stage="test", reason="the repository uses pytest, which the sandbox image does not "
                              "provide; turn the setup network on (setup installs pytest) or add pytest to the image "
                              "(sandboxes/image.py)", output_tail=tail, log=log.text())
    if baseline["ran"] == 0 and not baseline["passed"]:
        return InstallFailure(stage="test", reason=f"the test command ran no tests (exit {baseline['exit_code']})",
                              output_tail=tail, log=log.text())
    if not baseline["passed"]:
        return InstallFailure(stage="test", reason=f"no test passes on the clean repository ({baseline['ran']} ran): "
                              "tasks need tests that pass without a bug", output_tail=tail, log=log.text())
    ran = max(baseline["ran"], len(baseline["passed"]) + len(baseline["failed"]) + len(baseline["errored"]))
    recipe = replace(recipe, tests_ran=ran, tests_passed=len(baseline["passed"]), verified=True,
                     baseline={k: v for k, v in baseline.items() if k != "output_tail"})
    return PreparedEnvironment(recipe=recipe, snapshot=snapshot, paths=paths, log=log.text())


def repository_auto_install(*, backend, source, timeout_s: float = 600.0, budget: SetupBudget | None = None,
                            recipe: InstallRecipe | None = None) -> InstallRecipe | InstallFailure:
    """Detect, install and verify a repository in a sandbox; the recipe, or why it cannot be set up."""
    budget = budget or SetupBudget(test_timeout_s=timeout_s)
    prepared = environment_prepare(backend=backend, source=source, budget=budget, recipe=recipe)
    if isinstance(prepared, InstallFailure):
        return prepared
    _delete(backend, prepared.snapshot)
    return prepared.recipe
