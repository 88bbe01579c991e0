"""Auto-install for registered repositories: detect how to install and test, verify it in a sandbox.

Detection reads the usual files (pyproject.toml, setup.cfg, setup.py, requirements*.txt, tox.ini,
pytest.ini, conftest.py) and proposes a recipe: setup commands that install the project offline
into a private directory of the workspace, and a test command. The recipe is then run for real: the
snapshot is built with the setup commands and the test command must actually run tests. Sandboxes
have no network, so installs never download; a repository that cannot be set up is reported with
the stage that failed and the reason.
"""

from __future__ import annotations

import configparser
import re
import tomllib
from dataclasses import asdict, dataclass

from training.tasks.reward import parse_unittest_output

SITE_DIR = ".flowstate/site"
"""Where setup installs the project and its requirements, inside the workspace."""
_PYTEST_SUMMARY = re.compile(r"(?P<count>\d+) (?P<what>passed|failed|errors?|skipped|xfailed|xpassed)")


class InstallError(ValueError):
    """Detection found nothing usable; the message says what the repository is missing."""


@dataclass(frozen=True)
class InstallRecipe:
    """How to install and test one repository; `verified` once it ran in a sandbox."""

    setup_commands: tuple[str, ...]
    """Commands run once when the repository snapshot is built."""
    test_command: str
    """Command that runs the test suite verbosely from the repository root."""
    runner: str
    """"pytest" or "unittest"."""
    detected_from: tuple[str, ...]
    """Files the recipe was derived from."""
    tests_ran: int = 0
    """Tests the verification run executed."""
    tests_passed: int = 0
    """Tests that passed in the verification run."""
    verified: bool = False
    """True once the recipe was run in a sandbox and tests ran."""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class InstallFailure:
    """Why a repository could not be set up."""

    stage: str
    """"detect", "install" or "test"."""
    reason: str
    """What went wrong and what would fix it."""
    output_tail: str = ""
    """End of the failing command's output."""

    def as_dict(self) -> dict:
        return asdict(self)


def _uses_pytest(files: dict[str, str]) -> str | None:
    pyproject = files.get("pyproject.toml")
    if pyproject:
        try:
            data = tomllib.loads(pyproject)
        except tomllib.TOMLDecodeError as error:
            raise InstallError(f"pyproject.toml does not parse: {error}") from error
        if "pytest" in data.get("tool", {}):
            return "pyproject.toml"
    if "pytest.ini" in files:
        return "pytest.ini"
    for name, section in (("setup.cfg", "tool:pytest"), ("tox.ini", "pytest")):
        if name in files:
            parser = configparser.ConfigParser()
            try:
                parser.read_string(files[name])
            except configparser.Error as error:
                raise InstallError(f"{name} does not parse: {error}") from error
            if parser.has_section(section):
                return name
            if name == "tox.ini" and "pytest" in files[name]:
                return name
    if "conftest.py" in files:
        return "conftest.py"
    return None


def detect_recipe(files: dict[str, str], paths: list[str]) -> InstallRecipe:
    """Propose a recipe from the repository's configuration files (`files`) and its file list."""
    detected: list[str] = []
    setup: list[str] = []
    pythonpath = [SITE_DIR]
    requirement_files = sorted(name for name in files if re.fullmatch(r"requirements(-\w+)?\.txt", name))
    for name in requirement_files:
        if any(line.strip() and not line.strip().startswith("#") for line in files[name].splitlines()):
            setup.append(f"python3 -m pip install --no-index --quiet --target {SITE_DIR} -r {name}")
            detected.append(name)
    if any(name in files for name in ("pyproject.toml", "setup.py", "setup.cfg")):
        buildable = "setup.py" in files or "[build-system]" in files.get("pyproject.toml", "")
        if buildable:
            setup.append(
                f"python3 -m pip install --no-index --no-deps --no-build-isolation --quiet --target {SITE_DIR} ."
            )
        elif any(path.startswith("src/") for path in paths):
            pythonpath.append("src")
        detected.extend(name for name in ("pyproject.toml", "setup.py", "setup.cfg") if name in files)
    elif any(path.startswith("src/") for path in paths):
        pythonpath.append("src")
    pytest_source = _uses_pytest(files)
    has_tests = any(re.search(r"(^|/)test_[^/]*\.py$|(^|/)[^/]*_test\.py$", path) for path in paths)
    if not has_tests and not pytest_source:
        raise InstallError("no tests found: add test_*.py files (unittest or pytest) so changes can be verified")
    environment = f"PYTHONPATH={':'.join(pythonpath)}"
    if pytest_source:
        detected.append(pytest_source)
        command = f"{environment} python3 -m pytest -rA -q -p no:cacheprovider"
        runner = "pytest"
    else:
        start = "tests" if any(path.startswith("tests/") for path in paths) else "."
        top = "." if start == "tests" and any(path == "tests/__init__.py" for path in paths) else start
        command = f"{environment} python3 -m unittest discover -v -s {start} -t {top}"
        runner = "unittest"
    return InstallRecipe(
        setup_commands=tuple(setup), test_command=command, runner=runner, detected_from=tuple(detected)
    )


def count_tests(runner: str, output: str) -> tuple[int, int]:
    """(tests that ran, tests that passed) from a pytest or unittest run's output."""
    if runner == "unittest":
        statuses, ran = parse_unittest_output(output)
        return ran or 0, sum(1 for status in statuses.values() if status == "ok")
    counts: dict[str, int] = {}
    summary = [line for line in output.splitlines() if " in " in line and ("passed" in line or "failed" in line)]
    for match in _PYTEST_SUMMARY.finditer(summary[-1] if summary else ""):
        counts[match.group("what")] = int(match.group("count"))
    ran = counts.get("passed", 0) + counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    return ran, counts.get("passed", 0)


_CONFIG_NAMES = ("pyproject.toml", "setup.cfg", "setup.py", "tox.ini", "pytest.ini", "conftest.py")


def repository_files(sandbox) -> tuple[dict[str, str], list[str]]:
    """(configuration files by name, every file path) of the workspace, for ``detect_recipe``."""
    listing = sandbox.exec("find . -path ./.git -prune -o -type f -print | sed 's|^\\./||' | head -20000", timeout_s=60)
    paths = [line for line in listing.stdout.splitlines() if line]
    files = {}
    for name in paths:
        if name in _CONFIG_NAMES or re.fullmatch(r"requirements(-\w+)?\.txt", name):
            files[name] = sandbox.read_bytes(name).decode("utf-8", errors="replace")
    return files, paths


def repository_auto_install(*, backend, source, timeout_s: float = 600.0) -> InstallRecipe | InstallFailure:
    """Detect, install and verify a repository in a sandbox; the recipe, or why it cannot be set up."""
    from sandboxes.base import SandboxError, SnapshotError
    from training.tasks.sandboxing import DEFAULT_TASK_LIMITS

    try:
        plain = backend.snapshot_create(source=source)
    except (SnapshotError, OSError) as error:
        return InstallFailure(stage="detect", reason=f"the repository could not be fetched: {error}")
    sandbox = backend.sandbox_create(snapshot=plain, limits=DEFAULT_TASK_LIMITS)
    try:
        files, paths = repository_files(sandbox)
    except SandboxError as error:
        return InstallFailure(stage="detect", reason=f"could not read the repository: {error}")
    finally:
        sandbox.destroy()
    try:
        recipe = detect_recipe(files, paths)
    except InstallError as error:
        return InstallFailure(stage="detect", reason=str(error))
    try:
        snapshot = backend.snapshot_create(source=source, setup_commands=recipe.setup_commands)
    except SnapshotError as error:
        return InstallFailure(
            stage="install",
            reason="installing offline failed (sandboxes have no network: every dependency must already be "
            "in the sandbox image)",
            output_tail=str(error)[-2000:],
        )
    sandbox = backend.sandbox_create(snapshot=snapshot, limits=DEFAULT_TASK_LIMITS)
    try:
        if recipe.runner == "pytest":
            probe = sandbox.exec("python3 -c 'import pytest'", timeout_s=60)
            if probe.exit_code != 0:
                return InstallFailure(
                    stage="test", reason="the repository uses pytest, which the sandbox image does not provide; "
                    "add pytest to the image (sandboxes/image.py)", output_tail=probe.stderr[-500:],
                )
        result = sandbox.exec(recipe.test_command, timeout_s=timeout_s)
    finally:
        sandbox.destroy()
    output = result.stdout + "\n" + result.stderr
    ran, passed = count_tests(recipe.runner, output)
    if result.timed_out:
        return InstallFailure(stage="test", reason=f"the test suite ran past {timeout_s:.0f}s", output_tail=output[-2000:])
    if ran == 0:
        return InstallFailure(
            stage="test", reason=f"the test command ran no tests (exit {result.exit_code})", output_tail=output[-2000:]
        )
    return InstallRecipe(**{**recipe.as_dict(), "tests_ran": ran, "tests_passed": passed, "verified": True})
