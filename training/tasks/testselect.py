"""Which tests a mutation can change: a call map of the baseline, taken once per mining run.

Every mutation (training.tasks.mutations) changes the body of one function (or method), and that code
runs only when the function is called. So a test that never calls the function, directly or through a
closure it made, runs none of the changed code and keeps its baseline outcome. The call map
(training.tasks.callmap_plugin, run inside a sandbox) records which repository functions each test
calls; a mutation candidate then runs only the tests that call its function:

- none: no test can fail, so the candidate is rejected without a run (not fail-to-pass);
- some: only those run, with the tests that start a subprocess (the child's calls are not seen) and
  any the map does not know; fail-to-pass comes from them, and every other baseline-passing test is
  pass-to-pass by the argument above.

A candidate falls back to the whole suite when the function also runs outside tests (at import or in a
shared fixture, whose results every test may use), for history candidates (a reverted commit may change
anything in a file), when the map is missing or unusable, and when the selected run did not report
every selected test. The map is read from the sandbox as untrusted data: bounded, type-checked, and
only ever used to choose tests.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

PLUGIN_MODULE = "flowstate_callmap"
MAP_PATH = ".flowstate/callmap.json"
MAX_MAP_BYTES = 32_000_000
MAX_SELECTED_CHARS = 100_000
"""Longest node-id list put on one command line (a shell argument holds at most 128 KiB)."""


@dataclass
class CallMap:
    """Tests that call each function unit, and the units that run outside any test."""

    callers: dict[tuple[str, str], frozenset[str]] = field(default_factory=dict)
    """(path, qualified name) -> the tests that call it, named as the test output names them (a pytest
    ``-rA`` line ends a node id at its first space: training.tasks.testoutput)."""
    node_ids: dict[str, frozenset[str]] = field(default_factory=dict)
    """Test name -> the node ids it stands for (more than one when ids differ only after a space)."""
    outside: frozenset[tuple[str, str]] = frozenset()
    """Units called at import, collection or in shared fixtures."""
    always: frozenset[str] = frozenset()
    """Tests selected for every candidate (they start subprocesses, or the map does not know them)."""
    map_s: float = 0.0
    """Seconds the mapping run took."""

    def selection(self, *, path: str, function: str) -> frozenset[str] | None:
        """The tests a mutation of ``function`` in ``path`` can change; None: run the whole suite."""
        unit = (path, function)
        if not function or unit in self.outside:
            return None
        return self.callers.get(unit, frozenset()) | self.always


def selectable(recipe) -> bool:
    """Whether the recipe's command takes pytest node ids and the plugin (``python3 -m pytest`` last)."""
    command = recipe.test_command
    return recipe.runner == "pytest" and " -m pytest" in command and not any(c in command for c in ";&|<>`$(")


def map_command(recipe) -> str:
    return f"{recipe.test_command} -p {PLUGIN_MODULE}"


def selected_command(recipe, tests: frozenset[str], callmap: CallMap) -> str | None:
    """The test command restricted to ``tests``; None when a test has no known node id, or the list is too
    long for one line."""
    if any(test not in callmap.node_ids for test in tests):
        return None
    quoted = " ".join(shlex.quote(node) for test in sorted(tests) for node in sorted(callmap.node_ids[test]))
    return None if len(quoted) > MAX_SELECTED_CHARS else f"{recipe.test_command} {quoted}"


def _parse(data: bytes, baseline_passed: set[str]) -> CallMap | None:
    if len(data) > MAX_MAP_BYTES:
        return None
    try:
        raw = json.loads(data.decode("utf-8"))
        units = [(str(path), str(name)) for path, name in raw["units"]]
        tests = {str(test): [units[int(i)] for i in indices] for test, indices in raw["tests"].items()}
        outside = frozenset(units[int(i)] for i in raw["outside"])
        spawns = {str(test) for test in raw["spawns"]}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    callers: dict[tuple[str, str], set[str]] = {}
    node_ids: dict[str, set[str]] = {}
    for node, called in tests.items():
        test = node.split(" ")[0]
        node_ids.setdefault(test, set()).add(node)
        for unit in called:
            callers.setdefault(unit, set()).add(test)
    always = ({s.split(" ")[0] for s in spawns} | (baseline_passed - set(node_ids))) & baseline_passed
    return CallMap(callers={unit: frozenset(t) for unit, t in callers.items()}, outside=outside,
                   always=frozenset(always), node_ids={test: frozenset(n) for test, n in node_ids.items()})


def call_map_build(*, backend, prepared, timeout_s: float) -> tuple[CallMap | None, str]:
    """Run the suite once with the plugin in a sandbox of the prepared snapshot; (map, note)."""
    import time

    from sandboxes.base import SandboxError
    from training.tasks.environment import baseline_limits
    from training.tasks.testoutput import parse_test_output, passing_tests

    recipe = prepared.recipe
    if not selectable(recipe):
        return None, "the test command is not `python3 -m pytest ...`: every candidate runs the whole suite"
    plugin = (Path(__file__).with_name("callmap_plugin.py")).read_bytes()
    sandbox = backend.sandbox_create(snapshot=prepared.snapshot, limits=baseline_limits(timeout_s))
    started = time.monotonic()
    try:
        sandbox.write_bytes(f"{PLUGIN_MODULE}.py", plugin)
        result = sandbox.exec(map_command(recipe), timeout_s=timeout_s)
        data = sandbox.read_bytes(MAP_PATH) if not result.timed_out else b""
    except SandboxError as error:
        return None, f"the call map could not be taken ({error}): every candidate runs the whole suite"
    finally:
        sandbox.destroy()
    baseline = set(recipe.baseline.get("passed") or ())
    statuses, _ = parse_test_output(result.stdout + "\n" + result.stderr, recipe.runner)
    if result.timed_out or not baseline <= passing_tests(statuses):
        return None, "the suite under the call map did not pass as in the baseline: every candidate runs it whole"
    callmap = _parse(data, baseline)
    if callmap is None:
        return None, "the call map was unreadable: every candidate runs the whole suite"
    callmap.map_s = round(time.monotonic() - started, 2)
    return callmap, (f"call map of {len(baseline)} tests in {callmap.map_s}s: {len(callmap.callers)} functions "
                     f"called by tests, {len(callmap.outside)} outside tests, {len(callmap.always)} tests always run")
