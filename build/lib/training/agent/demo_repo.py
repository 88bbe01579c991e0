"""The demo repository (a tiny Python package with one failing test) and the scripted expert
that fixes it. Used by ``make run``'s demo data, the browser test and the event benchmark."""

from __future__ import annotations

import subprocess
from pathlib import Path

from training.agent.scripted import ScriptedExpertPolicy, ScriptedTurn

DEMO_PROMPT = "The test suite fails: `python3 -m unittest` reports a wrong median. Find the bug in the stats package and fix it."
TEST_COMMAND = "python3 -m unittest discover -s tests -q"

_BUGGY_LINE = "    return ordered[middle]\n"
_FIXED_LINES = (
    "    if len(ordered) % 2 == 0:\n"
    "        return (ordered[middle - 1] + ordered[middle]) / 2\n"
    "    return ordered[middle]\n"
)

DEMO_FILES: dict[str, str] = {
    "README.md": "# stats\n\nSmall descriptive statistics helpers.\n\nRun the tests with `python3 -m unittest discover -s tests`.\n",
    "stats/__init__.py": "from stats.summary import mean, median\n\n__all__ = [\"mean\", \"median\"]\n",
    "stats/summary.py": (
        '"""Descriptive statistics over lists of numbers."""\n\n\n'
        "def mean(values):\n"
        "    if not values:\n"
        "        raise ValueError(\"mean of an empty list\")\n"
        "    return sum(values) / len(values)\n\n\n"
        "def median(values):\n"
        "    if not values:\n"
        "        raise ValueError(\"median of an empty list\")\n"
        "    ordered = sorted(values)\n"
        "    middle = len(ordered) // 2\n"
        + _BUGGY_LINE
    ),
    "tests/__init__.py": "",
    "tests/test_summary.py": (
        "import unittest\n\nfrom stats import mean, median\n\n\n"
        "class SummaryTest(unittest.TestCase):\n"
        "    def test_mean(self):\n"
        "        self.assertEqual(mean([1, 2, 3, 4]), 2.5)\n\n"
        "    def test_median_odd(self):\n"
        "        self.assertEqual(median([3, 1, 2]), 2)\n\n"
        "    def test_median_even(self):\n"
        "        self.assertEqual(median([4, 1, 3, 2]), 2.5)\n\n\n"
        "if __name__ == \"__main__\":\n    unittest.main()\n"
    ),
}


def write_demo_repository(path: Path) -> Path:
    """Create the demo repository as a git repo at ``path`` (idempotent: an existing one is kept)."""
    path = Path(path)
    if (path / ".git").is_dir():
        return path
    path.mkdir(parents=True, exist_ok=True)
    for name, text in DEMO_FILES.items():
        target = path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    git = ["git", "-c", "user.name=Flowstate demo", "-c", "user.email=demo@flowstate.invalid", "-C", str(path)]
    subprocess.run([*git, "init", "-q", "-b", "main"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "stats package with a failing median test"], check=True)
    return path


def demo_expert_policy(*, step_delay_s: float = 0.0) -> ScriptedExpertPolicy:
    """The deterministic scripted expert for the demo repository (not a model)."""
    todos = [
        {"id": "reproduce", "content": "Reproduce the failing test", "status": "in_progress"},
        {"id": "fix", "content": "Fix median for even-length input", "status": "pending"},
        {"id": "verify", "content": "Run the whole suite", "status": "pending"},
    ]
    done = [dict(todo, status="completed") for todo in todos]
    return ScriptedExpertPolicy(
        step_delay_s=step_delay_s,
        turns=[
            ScriptedTurn("Plan the work and look at the repository.", (
                ("todo_write", {"todos": todos}),
                ("list_dir", {"path": "."}),
                ("read_file", {"path": "README.md"}),
            )),
            ScriptedTurn("Run the tests and find where median is defined.", (
                ("run_terminal", {"command": TEST_COMMAND}),
                ("grep", {"pattern": "def median", "path": "."}),
            )),
            ScriptedTurn("Read the implementation and related code.", (
                ("read_file", {"path": "stats/summary.py"}),
                ("semantic_search", {"query": "median of an even number of values"}),
            )),
            ScriptedTurn("median returns the upper middle element for even-length lists; average the two middle values.", (
                ("edit_file", {"path": "stats/summary.py", "old_str": _BUGGY_LINE, "new_str": _FIXED_LINES}),
            )),
            ScriptedTurn("Verify the fix.", (
                ("run_terminal", {"command": TEST_COMMAND}),
                ("todo_write", {"todos": done}),
            )),
        ],
        final_message=(
            "Fixed `median` in stats/summary.py: for an even number of values it now averages the two "
            "middle elements instead of returning the upper one. All tests pass."
        ),
    )
