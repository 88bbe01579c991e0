"""Rewards from hidden tests run inside the rollout's own sandbox, plus optional lint/format terms.

The hidden test files are written over the workspace right before the run, so an agent that edits
or deletes tests cannot change its score. A failure of the infrastructure (the sandbox died, the
interpreter is missing) raises `RewardInfrastructureError` instead of returning a zero: the trainer
masks such samples rather than punishing the policy for them.
"""

from __future__ import annotations

import difflib
import json
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from training.tasks.base import CodingTask, TaskError

# unittest -v prints "test_name (module.Class.test_name) ... ok", with the status possibly on the
# next line when the test has a docstring.
_TEST_LINE = re.compile(r"^(?P<method>\w+) \((?P<qualified>[\w.]+)\)")
_STATUS = re.compile(r" \.\.\. (?P<status>ok|FAIL|ERROR|skipped.*|expected failure|unexpected success)$")
_RAN = re.compile(r"^Ran (?P<count>\d+) tests? in ", re.MULTILINE)
_SHELL_MISSING_EXIT_CODES = (126, 127)


class RewardInfrastructureError(RuntimeError):
    """Scoring could not run for reasons outside the policy's control; never score this as zero."""


@dataclass(frozen=True)
class RewardConfig:
    """How a finished rollout is turned into a scalar reward."""

    partial_credit: bool = False
    """Give the fraction of passing hidden tests instead of 0/1 for "all tests pass"."""
    lint_weight: float = 0.0
    """Penalty subtracted when the edit adds ruff lint findings to the files it touched."""
    format_weight: float = 0.0
    """Penalty subtracted when the edit leaves touched files less `ruff format`-clean than before."""
    timeout_s: float | None = None
    """Limit of the hidden-test run; None uses the task's own test_timeout_s."""
    reference_similarity_weight: float = 0.0
    """SWE-RL-style shaping: a rollout whose hidden tests fail scores this weight times the similarity of
    its closest edit_file call to the task's reference fix (`reference_edit_similarity`), so groups where
    every rollout failed still rank a near-miss (the right line, one character off) above an edit of the
    wrong line or none. 0 leaves the reward test-only; a pass always scores 1."""

    def __post_init__(self) -> None:
        if self.lint_weight < 0 or self.format_weight < 0:
            raise TaskError("RewardConfig.lint_weight and format_weight must be >= 0 (they are penalties)")
        if self.lint_weight + self.format_weight > 1.0:
            raise TaskError(
                "RewardConfig.lint_weight + format_weight must be <= 1 so style never outweighs a passing fix"
            )
        if not 0 <= self.reference_similarity_weight < 1:
            raise TaskError(
                "RewardConfig.reference_similarity_weight must be in [0, 1) so a failing edit always scores "
                f"below a passing one; got {self.reference_similarity_weight}"
            )
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise TaskError("RewardConfig.timeout_s must be positive, or None for the task's own limit")
        if (self.lint_weight or self.format_weight) and not _ruff_available():
            raise TaskError("lint/format terms need ruff on PATH; install ruff or set the weights to 0")


@dataclass(frozen=True)
class Reward:
    """Score of one rollout and the evidence it was computed from."""

    value: float
    """The scalar reward in [-(lint_weight + format_weight), 1]."""
    passed: bool
    """Every fail-to-pass and pass-to-pass test passed."""
    tests_total: int
    """Tests the hidden suite ran."""
    tests_passed: int
    """Tests that passed."""
    fail_to_pass_passed: int
    """How many of the task's fail-to-pass tests now pass."""
    timed_out: bool
    """The hidden-test run hit its time limit (the code hangs); scored zero."""
    lint_penalty: float
    """Subtracted lint term (0 when disabled or clean)."""
    format_penalty: float
    """Subtracted format term (0 when disabled or clean)."""
    duration_s: float
    """Wall-clock seconds of the hidden-test run."""
    test_statuses: dict[str, str] = field(default_factory=dict)
    """Test id -> ok / FAIL / ERROR / skipped, as parsed from the runner output."""
    output_tail: str = ""
    """Last lines of the runner output, for the trace viewer."""
    reference_similarity: float | None = None
    """Similarity of the closest edit_file call to the reference fix, when the shaping term is on."""

    def as_dict(self) -> dict:
        return {
            "value": self.value,
            "passed": self.passed,
            "tests_total": self.tests_total,
            "tests_passed": self.tests_passed,
            "fail_to_pass_passed": self.fail_to_pass_passed,
            "timed_out": self.timed_out,
            "lint_penalty": self.lint_penalty,
            "format_penalty": self.format_penalty,
            "duration_s": self.duration_s,
            "reference_similarity": self.reference_similarity,
        }


def parse_unittest_output(text: str) -> tuple[dict[str, str], int | None]:
    """Per-test statuses keyed "module.Class.method" and the "Ran N tests" count (None if absent)."""
    statuses: dict[str, str] = {}
    pending: str | None = None
    for line in text.splitlines():
        match = _TEST_LINE.match(line)
        if match:
            qualified = match.group("qualified")
            pending = (
                qualified
                if qualified.endswith(match.group("method"))
                else f"{qualified}.{match.group('method')}"
            )
        status = _STATUS.search(line)
        if status and pending:
            value = status.group("status")
            statuses[pending] = "skipped" if value.startswith("skipped") else value
            pending = None
    ran = _RAN.search(text)
    return statuses, int(ran.group("count")) if ran else None


def _ruff_available() -> bool:
    try:
        _ruff_executable()
    except (ImportError, FileNotFoundError):
        return False
    return True


def _ruff_executable() -> str:
    executable = shutil.which("ruff")
    if executable:
        return executable
    from ruff.__main__ import find_ruff_bin

    return find_ruff_bin()


def _ruff(args: list[str], text: str, path: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_ruff_executable(), *args, "--stdin-filename", path, "-"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _lint_findings(text: str, path: str) -> int:
    result = _ruff(["check", "--no-cache", "--output-format", "json", "--isolated"], text, path)
    try:
        return len(json.loads(result.stdout or "[]"))
    except json.JSONDecodeError as exc:
        raise RewardInfrastructureError(f"ruff check gave unreadable output: {result.stderr[-500:]}") from exc


def _format_distance(text: str, path: str) -> int:
    """Lines `ruff format` would change; a syntax error counts as every line."""
    result = _ruff(["format", "--isolated"], text, path)
    if result.returncode != 0:
        return max(1, len(text.splitlines()))
    diff = difflib.unified_diff(text.splitlines(), result.stdout.splitlines(), lineterm="", n=0)
    return sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))


def _touched_python_files(*, sandbox, task: CodingTask) -> dict[str, tuple[str, str]]:
    """path -> (text before, text after) for every task .py file the rollout changed."""
    touched = {}
    for path, before in task.files.items():
        if not path.endswith(".py") or path in task.hidden_tests:
            continue
        try:
            after = sandbox.read_bytes(path).decode("utf-8", errors="replace")
        except FileNotFoundError:
            after = ""
        except OSError as exc:
            raise RewardInfrastructureError(f"could not read {path} from the sandbox: {exc}") from exc
        if after != before:
            touched[path] = (before, after)
    return touched


REFERENCE_SIMILARITY_MAX_CHARS = 4000
"""Longer edit_file arguments are cut to this many characters before comparison (difflib is quadratic)."""


def reference_edit_similarity(*, task: CodingTask, edit_arguments: Sequence[Mapping]) -> float:
    """How close the agent's closest edit_file call came to the reference fix, in [0, 1].

    SWE-RL (Wei et al., 2025) rewards a patch by its difflib similarity to the oracle patch; here the
    patch is one call's `old_str` and `new_str`, compared with the reference's old and new text joined the
    same way, so both the copy of the faulty line and the fix count. Calls that were rejected count too:
    the failure this term targets is an `old_str` that misses the file by a character. Calls on another
    file, or with arguments that are not strings, score 0.
    """
    from sandboxes.base import SandboxError
    from sandboxes.safe_fs import normalize_relative

    solution = task.solution
    reference = _edit_text(solution.old_text, solution.new_text)
    best = 0.0
    for arguments in edit_arguments:
        old, new, path = arguments.get("old_str"), arguments.get("new_str"), arguments.get("path")
        if not (isinstance(old, str) and isinstance(new, str) and isinstance(path, str)):
            continue
        try:
            if normalize_relative(path) != normalize_relative(solution.path):
                continue
        except SandboxError:
            continue
        matcher = difflib.SequenceMatcher(None, _edit_text(old, new), reference, autojunk=False)
        if matcher.real_quick_ratio() > best and matcher.quick_ratio() > best:
            best = max(best, matcher.ratio())
    return best


def _edit_text(old: str, new: str) -> str:
    limit = REFERENCE_SIMILARITY_MAX_CHARS
    return f"{old.strip()[:limit]}\n=>\n{new.strip()[:limit]}"


def _probe_sandbox(sandbox) -> None:
    """The tests printed no summary: either the agent's code killed the interpreter (policy behaviour) or
    the sandbox is broken (infrastructure, raised)."""
    try:
        probe = sandbox.exec("python3 -c 'print(42)'", timeout_s=30)
    except Exception as exc:
        raise RewardInfrastructureError(f"sandbox probe failed: {exc}") from exc
    if probe.exit_code != 0 or probe.stdout.strip() != "42":
        raise RewardInfrastructureError(f"sandbox cannot run python3: {probe.stderr.strip()[-300:]}")


def _style_penalties(touched: Mapping[str, tuple[str, str]], config: RewardConfig) -> tuple[float, float]:
    """(lint, format) penalties: each applies once when any touched file got worse on that count."""
    lint_penalty = format_penalty = 0.0
    for path, (before, after) in touched.items():
        if config.lint_weight and _lint_findings(after, path) > _lint_findings(before, path):
            lint_penalty = config.lint_weight
        if config.format_weight and _format_distance(after, path) > _format_distance(before, path):
            format_penalty = config.format_weight
    return lint_penalty, format_penalty


def score_rollout(
    *, sandbox, task: CodingTask, config: RewardConfig | None = None, edit_arguments: Sequence[Mapping] = ()
) -> Reward:
    """Run the task's hidden tests in `sandbox` (the agent's final workspace) and score them.

    `edit_arguments` are the rollout's edit_file call arguments, read only by the reference-similarity term.
    """
    config = config or RewardConfig()
    touched = (
        _touched_python_files(sandbox=sandbox, task=task)
        if (config.lint_weight or config.format_weight)
        else {}
    )
    try:
        for path, text in task.hidden_tests.items():
            sandbox.write_bytes(path, text.encode("utf-8"))
        result = sandbox.exec(task.test_command, timeout_s=config.timeout_s or task.test_timeout_s)
    except Exception as exc:  # any backend failure here is infrastructure, not policy behaviour
        raise RewardInfrastructureError(
            f"hidden tests could not run in sandbox: {type(exc).__name__}: {exc}"
        ) from exc

    from training.tasks.testoutput import parse_test_output

    output = f"{result.stdout}\n{result.stderr}"
    statuses, ran = parse_test_output(output)  # unittest -v, or pytest -rA for mined repository tasks
    if result.exit_code in _SHELL_MISSING_EXIT_CODES and ran is None and not result.timed_out:
        raise RewardInfrastructureError(
            f"the test command could not start (exit {result.exit_code}): {output.strip()[-300:]}"
        )
    if ran is None and not result.timed_out:
        _probe_sandbox(sandbox)

    passed_ids = {
        test_id for test_id, status in statuses.items() if status in ("ok", "skipped", "expected failure")
    }
    required = set(task.fail_to_pass) | set(task.pass_to_pass)
    fail_to_pass_passed = sum(1 for test_id in task.fail_to_pass if test_id in passed_ids)
    all_passed = not result.timed_out and result.exit_code == 0 and required <= passed_ids and ran is not None
    tests_total = ran if ran is not None else len(required)
    tests_passed = len(passed_ids)
    if result.timed_out:
        base = 0.0
    elif config.partial_credit:
        base = tests_passed / max(1, len(required | set(statuses)))
    else:
        base = 1.0 if all_passed else 0.0
    similarity = None
    if config.reference_similarity_weight:
        similarity = reference_edit_similarity(task=task, edit_arguments=edit_arguments)
        if not all_passed and not result.timed_out:
            # A hang scores zero whatever the edit looked like: the term ranks attempts, it never pays for a
            # program that no longer terminates.
            base = max(base, config.reference_similarity_weight * similarity)

    lint_penalty, format_penalty = _style_penalties(touched, config)
    return Reward(
        value=base - lint_penalty - format_penalty,
        passed=all_passed,
        tests_total=tests_total,
        tests_passed=tests_passed,
        fail_to_pass_passed=fail_to_pass_passed,
        timed_out=result.timed_out,
        lint_penalty=lint_penalty,
        format_penalty=format_penalty,
        duration_s=result.duration_s,
        test_statuses=statuses,
        output_tail="\n".join(output.strip().splitlines()[-30:]),
        reference_similarity=similarity,
    )
