"""Auto-install for registered repositories: detect how to install and test, verify it in a sandbox.

Detection reads the usual files (pyproject.toml, setup.cfg, setup.py, requirements*.txt, tox.ini,
pytest.ini, conftest.py) and proposes a recipe: setup commands that install the project offline
into a private directory of the workspace, and a test command. The recipe is then run for real: the
snapshot is built with the setup commands and the test command must actually run tests. Test runs
never have network. The setup phase may (``SetupBudget.network``): then requirements and the test
runner are installed from the package index, within the budget's time and disk limits; without it
installs never download. The baseline run records which tests pass, fail and error on the clean
repository and how long the suite takes. A repository that cannot be set up is reported with the
stage that failed, the reason and the log.
"""

from __future__ import annotations

import configparser
import re
import tomllib
from dataclasses import asdict, dataclass, field

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
    network: bool = False
    """The setup commands download from the package index (the setup phase runs with the network on)."""
    baseline: dict = field(default_factory=dict)
    """The clean repository's test run: passed / failed / errored test ids, ran, duration_s."""

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> InstallRecipe:
        """A recipe from its stored (or user-edited) dict; unknown keys are refused by name."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise InstallError(f"unknown recipe fields {unknown}")
        values = dict(data)
        for name in ("setup_commands", "detected_from"):
            values[name] = tuple(values.get(name) or ())
        if values.get("runner") not in ("pytest", "unittest"):
            raise InstallError("runner must be 'pytest' or 'unittest'")
        if not str(values.get("test_command") or "").strip():
            raise InstallError("the recipe needs a test command")
        return cls(**values)


@dataclass(frozen=True)
class SetupBudget:
    """Limits of one repository's environment setup."""

    network: bool = False
    """Let the setup phase reach the package index (test runs never have network)."""
    setup_timeout_s: float = 600.0
    """Wall-clock limit of each setup command."""
    setup_disk_mb: int = 2048
    """Disk the setup phase may fill (the snapshot's size budget: repository, installed packages)."""
    test_timeout_s: float = 600.0
    """Limit of the baseline test run; a suite that runs past it is reported as hanging."""

    def __post_init__(self) -> None:
        if self.setup_timeout_s <= 0 or self.test_timeout_s <= 0 or self.setup_disk_mb < 16:
            raise InstallError("setup budget: timeouts must be > 0 and setup_disk_mb >= 16")


@dataclass(frozen=True)
class InstallFailure:
    """Why a repository could not be set up."""

    stage: str
    """"detect", "install" or "test"."""
    reason: str
    """What went wrong and what would fix it."""
    output_tail: str = ""
    """End of the failing command's output."""
    log: str = ""
    """What setup did up to the failure: each step and its output (bounded)."""

    def as_dict(self) -> dict:
        return asdict(self)


_TEST_FILE = re.compile(r"(^|/)test_[^/]*\.py$|(^|/)[^/]*_test\.py$")
_IMPORTS_PYTEST = re.compile(r"^\s*(import pytest\b|from pytest\b)", re.M)
MAX_READ_TEST_FILES = 50
"""Test files ``repository_files`` reads to see whether they import pytest."""


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
    for name in sorted(files):
        if _TEST_FILE.search(name) and _IMPORTS_PYTEST.search(files[name]):
            return name  # a test file that imports pytest (fixtures, parametrize, raises) needs pytest
    return None


def detect_recipe(files: dict[str, str], paths: list[str], *, network: bool = False) -> InstallRecipe:
    """Propose a recipe from the repository's configuration files (`files`) and its file list.

    With ``network`` the setup commands download (requirements, dependencies, pytest) and pytest runs the
    tests whenever there are any (it runs unittest suites too); without it nothing is downloaded."""
    index = "" if network else "--no-index "
    detected: list[str] = []
    setup: list[str] = []
    pythonpath = [SITE_DIR]
    requirement_files = sorted(name for name in files if re.fullmatch(r"requirements(-\w+)?\.txt", name))
    for name in requirement_files:
        if any(line.strip() and not line.strip().startswith("#") for line in files[name].splitlines()):
            setup.append(f"python3 -m pip install {index}--quiet --target {SITE_DIR} -r {name}")
            detected.append(name)
    if any(name in files for name in ("pyproject.toml", "setup.py", "setup.cfg")):
        buildable = "setup.py" in files or "[build-system]" in files.get("pyproject.toml", "")
        if buildable:
            offline = "--no-index --no-deps --no-build-isolation "
            setup.append(f"python3 -m pip install {'' if network else offline}--quiet --target {SITE_DIR} .")
        elif any(path.startswith("src/") for path in paths):
            pythonpath.append("src")
        detected.extend(name for name in ("pyproject.toml", "setup.py", "setup.cfg") if name in files)
    elif any(path.startswith("src/") for path in paths):
        pythonpath.append("src")
    pytest_source = _uses_pytest(files) or (
        "noxfile.py" if "pytest" in files.get("noxfile.py", "") else None
    )
    has_tests = any(re.search(r"(^|/)test_[^/]*\.py$|(^|/)[^/]*_test\.py$", path) for path in paths)
    if not has_tests and not pytest_source:
        raise InstallError("no tests found: add test_*.py files (unittest or pytest) so changes can be verified")
    environment = f"PYTHONPATH={':'.join(pythonpath)}"
    if network and (pytest_source or has_tests):
        setup.insert(0, f"python3 -m pip install --quiet --target {SITE_DIR} pytest")
    if pytest_source or (network and has_tests):
        detected.append(pytest_source or "tests")
        command = f"{environment} python3 -m pytest -rA -q -p no:cacheprovider"
        runner = "pytest"
    else:
        start = "tests" if any(path.startswith("tests/") for path in paths) else "."
        top = "." if start == "tests" and any(path == "tests/__init__.py" for path in paths) else start
        command = f"{environment} python3 -m unittest discover -v -s {start} -t {top}"
        runner = "unittest"
    return InstallRecipe(
        setup_commands=tuple(setup), test_command=command, runner=runner, detected_from=tuple(detected),
        network=network,
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


_CONFIG_NAMES = ("pyproject.toml", "setup.cfg", "setup.py", "tox.ini", "pytest.ini", "conftest.py", "noxfile.py")


def repository_files(sandbox) -> tuple[dict[str, str], list[str]]:
    """(configuration files by name, every file path) of the workspace, for ``detect_recipe``."""
    listing = sandbox.exec("find . -path ./.git -prune -o -type f -print | sed 's|^\\./||' | head -20000", timeout_s=60)
    paths = [line for line in listing.stdout.splitlines() if line]
    files = {}
    for name in paths:
        if name in _CONFIG_NAMES or re.fullmatch(r"requirements(-\w+)?\.txt", name):
            files[name] = sandbox.read_bytes(name).decode("utf-8", errors="replace")
    for name in [path for path in paths if _TEST_FILE.search(path)][:MAX_READ_TEST_FILES]:
        files[name] = sandbox.read_bytes(name)[:200_000].decode("utf-8", errors="replace")
    return files, paths


