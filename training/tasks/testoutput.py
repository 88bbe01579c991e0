"""Per-test statuses from a test run's output, for unittest (-v) and pytest (-rA) alike.

Statuses use unittest's words everywhere: "ok", "FAIL", "ERROR", "skipped", "expected failure",
"unexpected success". pytest's short summary (``-rA``) names every test with its outcome
("PASSED tests/test_x.py::TestC::test_a"), so a pytest id is ``path::Class::name``; a collection
error names a file, not a test, and is kept under that file's name with status "ERROR".
"""

from __future__ import annotations

import re

from training.tasks.reward import parse_unittest_output

_PYTEST_LINE = re.compile(r"^(?P<word>PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (?P<id>\S+)")
_PYTEST_WORDS = {
    "PASSED": "ok", "FAILED": "FAIL", "ERROR": "ERROR", "XFAIL": "expected failure",
    "XPASS": "unexpected success", "SKIPPED": "skipped",
}
# The final line: "=== 3 passed, 1 failed in 0.12s ===", or without the rule under -q ("3 passed in 0.12s").
_PYTEST_SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)|"
                             r"no tests ran)\b.* in [\d.]+s\b")
_PYTEST_COUNT = re.compile(r"(?P<count>\d+) (?P<what>passed|failed|errors?|xfailed|xpassed|skipped)")
PASSING = frozenset({"ok", "skipped", "expected failure"})
"""Statuses that count as a test not failing."""


def parse_pytest_output(text: str) -> tuple[dict[str, str], int | None]:
    """Per-test statuses keyed by pytest node id, and the number of tests that ran (None: no summary)."""
    statuses: dict[str, str] = {}
    for line in text.splitlines():
        match = _PYTEST_LINE.match(line)
        if match and match.group("id") != "[":
            if match.group("word") == "SKIPPED":
                continue  # "SKIPPED [1] path:line: reason" names no test id
            test_id = match.group("id")
            word = _PYTEST_WORDS[match.group("word")]
            # A test that failed and then errored in teardown keeps its failure.
            if statuses.get(test_id) not in ("FAIL",):
                statuses[test_id] = word
    summaries = [line for line in text.splitlines() if _PYTEST_SUMMARY.match(line)]
    if not summaries:
        return statuses, None
    last = summaries[-1]
    counts = {m.group("what"): int(m.group("count")) for m in _PYTEST_COUNT.finditer(last)}
    ran = sum(counts.get(key, 0) for key in ("passed", "failed", "error", "errors", "xfailed", "xpassed"))
    return statuses, ran


def parse_test_output(text: str, runner: str | None = None) -> tuple[dict[str, str], int | None]:
    """Statuses and ran-count of a unittest or pytest run (``runner`` forces one; None tries both)."""
    if runner != "pytest":
        statuses, ran = parse_unittest_output(text)
        if ran is not None or statuses or runner == "unittest":
            return statuses, ran
    return parse_pytest_output(text)


def passing_tests(statuses: dict[str, str]) -> set[str]:
    """Test ids whose status counts as not failing."""
    return {test_id for test_id, status in statuses.items() if status in PASSING}
