"""A pytest plugin that repository mining runs INSIDE a sandbox (never imported on the host): which of the
repository's functions each test calls.

training.tasks.test_selection writes this file into the workspace of a sandbox forked from the prepared
snapshot as ``flowstate_callmap.py`` and runs the recipe's test command with ``-p flowstate_callmap``
once. A profile hook (``sys.setprofile``, every thread) records the code objects started while each test
runs (setup, call, teardown); code run outside any test (imports at collection, session/module/class
fixtures, whose results tests share) goes to "outside". Tests that start a subprocess are listed apart
(what the child runs is not seen). The map is written to ``.flowstate/callmap.json``:

    {"version": 1, "units": [[path, unit], ...], "tests": {nodeid: [unit index, ...]},
     "outside": [unit index, ...], "spawns": [nodeid, ...]}

A unit is a top-level function or a method of a top-level class (the qualified name up to ".<locals>",
so a closure counts as the function that made it): what one mutation changes.
"""

import json
import os
import subprocess
import sys
import threading

import pytest

_ROOT = os.getcwd() + os.sep
_SKIP = (os.path.join(_ROOT, ".flowstate") + os.sep, os.path.join(_ROOT, "flowstate_callmap.py"))
_OUTSIDE: set = set()
_bucket = [_OUTSIDE]
_tests: dict = {}
_spawns: set = set()
_current = [None]


def _profile(frame, event, arg):
    if event == "call":
        _bucket[0].add(frame.f_code)


def _spawn_flag(original):
    def wrapper(*args, **kwargs):
        if _current[0] is not None:
            _spawns.add(_current[0])
        return original(*args, **kwargs)

    return wrapper


def pytest_configure(config):
    subprocess.Popen._execute_child = _spawn_flag(subprocess.Popen._execute_child)
    for name in ("system", "fork", "posix_spawn", "posix_spawnp", "execv", "execve"):
        if hasattr(os, name):
            setattr(os, name, _spawn_flag(getattr(os, name)))
    threading.setprofile(_profile)
    sys.setprofile(_profile)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    codes = _tests.setdefault(item.nodeid, set())
    _bucket[0], _current[0] = codes, item.nodeid
    try:
        yield
    finally:
        _bucket[0], _current[0] = _OUTSIDE, None


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope == "function":
        yield
        return
    saved = _bucket[0]
    _bucket[0] = _OUTSIDE  # a shared fixture's result reaches tests that did not call what made it
    try:
        yield
    finally:
        _bucket[0] = saved


def _unit(code):
    path = code.co_filename
    if not path.startswith(_ROOT) or path.startswith(_SKIP):
        return None
    qualname = getattr(code, "co_qualname", code.co_name)
    return path[len(_ROOT):], qualname.split(".<locals>")[0]


def pytest_unconfigure(config):
    sys.setprofile(None)
    threading.setprofile(None)
    units: dict = {}

    def indices(codes):
        found = set()
        for code in list(codes):
            unit = _unit(code)
            if unit is not None:
                found.add(units.setdefault(unit, len(units)))
        return sorted(found)

    tests = {nodeid: indices(codes) for nodeid, codes in _tests.items()}
    outside = indices(_OUTSIDE)
    os.makedirs(os.path.join(_ROOT, ".flowstate"), exist_ok=True)
    with open(os.path.join(_ROOT, ".flowstate", "callmap.json"), "w") as handle:
        json.dump({"version": 1, "units": [list(u) for u in sorted(units, key=units.get)], "tests": tests,
                   "outside": outside, "spawns": sorted(_spawns)}, handle)
