"""Real tier: bugs injected into real code with real tests, kept only if validated fail-to-pass.

Source: the CPython standard library of the running interpreter together with its own test suite
(`Lib/test/test_<module>.py`). A task repository holds the module and its test file at the root;
`python3 -m unittest -v test_<module>` imports the local copy first, so the injected bug is what the
tests exercise. For every candidate mutation (training.tasks.mutations) the tests run in a real
sandbox: a task is kept only when some tests that pass on the clean module fail with the bug
(fail-to-pass), everything else that passed still passes (pass-to-pass), and its fingerprint is new
(deduplication). The train / held-out split is by module, so no held-out code is trained on.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from training.tasks.base import CodingTask, TaskError, minimal_fix_edit
from training.tasks.mutations import enumerate_mutations
from training.tasks.reward import parse_unittest_output

DEFAULT_STDLIB_MODULES: tuple[str, ...] = (
    "bisect",
    "colorsys",
    "fnmatch",
    "fractions",
    "getopt",
    "heapq",
    "keyword",
    "shlex",
    "string",
    "textwrap",
    "difflib",
    "calendar",
    "glob",
)
HELDOUT_SHARE_PERCENT = 25


def module_split(module: str) -> str:
    """ "heldout" for a fixed, hash-chosen quarter of modules, "train" for the rest."""
    bucket = int(hashlib.sha256(module.encode()).hexdigest()[:8], 16) % 100
    return "heldout" if bucket < HELDOUT_SHARE_PERCENT else "train"


@dataclass(frozen=True)
class RealTierConfig:
    """Which stdlib modules to mine and how many bugs to try in each."""

    modules: tuple[str, ...] = DEFAULT_STDLIB_MODULES
    """Pure-Python stdlib modules that have Lib/test/test_<module>.py."""
    candidates_per_module: int = 6
    """Mutations tried per module (each costs one sandboxed test run)."""
    seed: int = 0
    """Seeds the choice of candidate mutations."""
    test_timeout_s: float = 60.0
    """Limit of one test run; a mutant that hangs is rejected."""
    split: str | None = None
    """Mine only modules of this split ("train" / "heldout"); None mines both."""

    def __post_init__(self) -> None:
        if not self.modules:
            raise TaskError("RealTierConfig.modules is empty; name at least one stdlib module")
        if self.candidates_per_module < 1:
            raise TaskError("RealTierConfig.candidates_per_module must be >= 1")
        if self.split not in (None, "train", "heldout"):
            raise TaskError("RealTierConfig.split must be 'train', 'heldout' or None")


@dataclass
class MiningReport:
    """Kept tasks and every rejected candidate with its reason."""

    tasks: list[CodingTask] = field(default_factory=list)
    rejected: list[dict] = field(default_factory=list)


def stdlib_repository(module: str) -> tuple[dict[str, str], str]:
    """The task repository of a stdlib module (module + its test file) and the test module name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    source = stdlib / f"{module}.py"
    tests = stdlib / "test" / f"test_{module}.py"
    if not source.is_file():
        raise TaskError(f"{module} is not a single-file pure-Python stdlib module ({source} missing)")
    if not tests.is_file():
        raise TaskError(
            f"this interpreter ships no {tests}; install its test suite (e.g. the python3-test package) "
            "or choose another module"
        )
    return {f"{module}.py": source.read_text(), f"test_{module}.py": tests.read_text()}, f"test_{module}"


def _run_tests(*, backend, snapshot, files_override: dict[str, str], command: str, timeout_s: float):
    from training.tasks.sandboxing import DEFAULT_TASK_LIMITS

    sandbox = backend.sandbox_create(snapshot=snapshot, limits=DEFAULT_TASK_LIMITS)
    try:
        for path, text in files_override.items():
            sandbox.write_bytes(path, text.encode())
        result = sandbox.exec(command, timeout_s=timeout_s)
    finally:
        sandbox.destroy()
    statuses, ran = parse_unittest_output(result.stdout + "\n" + result.stderr)
    return result, statuses, ran


def _issue_text(module: str, command: str, output: str, failing: list[str]) -> str:
    lines = output.splitlines()
    message = next(
        (
            line.strip()
            for line in lines
            if line.startswith(
                ("AssertionError", "TypeError", "ValueError", "IndexError", "KeyError", "AttributeError")
            )
        ),
        "",
    )
    detail = f"\n\nThe first failure reports: `{message[:300]}`" if message else ""
    shown = ", ".join(f"`{name.rsplit('.', 1)[-1]}`" for name in failing[:3])
    more = f" and {len(failing) - 3} more" if len(failing) > 3 else ""
    return (
        f"The test suite of the `{module}` module fails: {shown}{more} no longer pass when running "
        f"`{command}`.{detail}\n\nFind the bug in `{module}.py` and fix it. Do not modify the tests."
    )


def mine_stdlib_tasks(
    *,
    config: RealTierConfig,
    backend,
    known_fingerprints: frozenset[str] = frozenset(),
    on_progress: Callable[[str], None] | None = None,
) -> MiningReport:
    """Inject bugs into each module and keep those that validate fail-to-pass in a sandbox.

    `known_fingerprints` (task ids' suffixes of an existing task set) are skipped as duplicates, so
    mining can be repeated with other seeds and only adds new bugs.
    """
    from sandboxes.base import RepoSource

    report = MiningReport()
    seen: set[str] = set(known_fingerprints)
    rng = random.Random(config.seed)
    for module in config.modules:
        split = module_split(module)
        if config.split is not None and split != config.split:
            continue
        try:
            files, test_module = stdlib_repository(module)
        except TaskError as error:
            report.rejected.append({"module": module, "reason": str(error)})
            continue
        command = f"python3 -m unittest -v {test_module}"
        with tempfile.TemporaryDirectory(prefix=f"flowstate-real-{module}-") as directory:
            for path, text in files.items():
                (Path(directory) / path).write_text(text)
            snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=directory))
        baseline, baseline_statuses, ran = _run_tests(
            backend=backend,
            snapshot=snapshot,
            files_override={},
            command=command,
            timeout_s=config.test_timeout_s,
        )
        passing = {name for name, status in baseline_statuses.items() if status == "ok"}
        if ran is None or not passing or baseline.timed_out:
            reason = f"clean tests do not run in the sandbox (exit {baseline.exit_code})"
            report.rejected.append({"module": module, "reason": reason, "output": baseline.stderr[-500:]})
            continue
        source_path = f"{module}.py"
        mutations = enumerate_mutations(files[source_path], path=source_path)
        rng.shuffle(mutations)
        for mutation in mutations[: config.candidates_per_module]:
            if mutation.fingerprint in seen:
                report.rejected.append(
                    {"module": module, "reason": "duplicate", "mutation": mutation.description}
                )
                continue
            seen.add(mutation.fingerprint)
            result, statuses, _ = _run_tests(
                backend=backend,
                snapshot=snapshot,
                files_override={source_path: mutation.mutated_source},
                command=command,
                timeout_s=config.test_timeout_s,
            )
            if result.timed_out:
                report.rejected.append(
                    {"module": module, "reason": "tests hang with the bug", "mutation": mutation.description}
                )
                continue
            fail_to_pass = sorted(name for name in passing if statuses.get(name) != "ok")
            if not fail_to_pass:
                report.rejected.append(
                    {
                        "module": module,
                        "reason": "no test fails with the bug (not fail-to-pass)",
                        "mutation": mutation.description,
                        "line": mutation.lineno,
                    }
                )
                continue
            pass_to_pass = sorted(passing - set(fail_to_pass))
            buggy_files = {**files, source_path: mutation.mutated_source}
            task = CodingTask(
                task_id=f"real-{module}-{mutation.fingerprint}",
                tier="real",
                split=split,
                prompt=_issue_text(module, command, result.stdout + result.stderr, fail_to_pass),
                files=buggy_files,
                hidden_tests={f"{test_module}.py": files[f"{test_module}.py"]},
                test_command=command,
                fail_to_pass=tuple(fail_to_pass),
                pass_to_pass=tuple(pass_to_pass),
                solution=minimal_fix_edit(
                    path=source_path, buggy=mutation.mutated_source, fixed=mutation.original_source
                ),
                mutation_kind=mutation.kind,
                mutation_description=mutation.description,
                metadata={
                    "module": module,
                    "function": mutation.function,
                    "line": mutation.lineno,
                    "source": "cpython-stdlib",
                },
                test_timeout_s=config.test_timeout_s,
            )
            report.tasks.append(task)
            if on_progress is not None:
                on_progress(
                    f"kept {task.task_id} ({mutation.kind} in {mutation.function}, {len(fail_to_pass)} f2p)"
                )
    return report
