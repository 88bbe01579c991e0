"""Environment setup and task mining on a small repository built in the test (local sandbox backend)."""

from __future__ import annotations

from sandboxes import get_backend
from sandboxes.base import RepoSource
from training.tasks.autoinstall import InstallFailure, SetupBudget
from training.tasks.base import CodingTask
from training.tasks.environment import PreparedEnvironment, environment_prepare
from training.tasks.repo_mining import MiningConfig, bug_report, mine_repository_tasks


def test_environment_records_baseline_and_mining_validates_tasks(small_repository):
    backend = get_backend("local")
    prepared = environment_prepare(backend=backend, source=RepoSource(kind="path", location=str(small_repository)),
                                   budget=SetupBudget(test_timeout_s=60))
    assert isinstance(prepared, PreparedEnvironment), prepared
    baseline = prepared.recipe.baseline
    assert len(baseline["passed"]) == 8 and not baseline["failed"] and baseline["duration_s"] > 0
    result = mine_repository_tasks(backend=backend, prepared=prepared, repo_label="calc",
                                   config=MiningConfig(max_candidates=14, max_tasks=6, seed=1, expert_check=False))
    assert result.proposed["history"] == 2 and result.tried >= len(result.tasks) >= 4
    history = [t for t in result.tasks if t.metadata["source"] == "history"]
    assert {t.fail_to_pass for t in history} >= {("tests.test_ops.OpsTest.test_clamp_high",)}
    for task in result.tasks:
        assert task.tier == "repo" and task.fail_to_pass and set(task.fail_to_pass).isdisjoint(task.pass_to_pass)
        assert not any(path.startswith(".git") for path in task.files)
        assert task.solution.new_text.strip() not in task.prompt  # the report never shows the fix
        assert CodingTask.from_json(task.to_json()) == task
    assert {t.split for t in result.tasks} == {"train", "heldout"}
    heldout_files = {t.solution.path for t in result.tasks if t.split == "heldout"}
    assert heldout_files.isdisjoint({t.solution.path for t in result.tasks if t.split == "train"})
    assert sum(result.rejected.values()) + len(result.tasks) == result.tried


def test_setup_failures_name_their_step(tmp_path):
    backend = get_backend("local")
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "main.py").write_text("print(1)\n")
    failure = environment_prepare(backend=backend, source=RepoSource(kind="path", location=str(tmp_path / "none")))
    assert isinstance(failure, InstallFailure) and failure.stage == "detect" and "no tests" in failure.reason
    never = tmp_path / "never"
    (never / "tests").mkdir(parents=True)
    (never / "tests" / "test_x.py").write_text(
        "import unittest\n\nclass T(unittest.TestCase):\n    def test_a(self):\n        self.fail('no')\n")
    failure = environment_prepare(backend=backend, source=RepoSource(kind="path", location=str(never)))
    assert failure.stage == "test" and "no test passes" in failure.reason and "test_a" in failure.log
    (never / "tests" / "test_x.py").write_text(
        "import time, unittest\n\nclass T(unittest.TestCase):\n    def test_a(self):\n        time.sleep(60)\n")
    failure = environment_prepare(backend=backend, source=RepoSource(kind="path", location=str(never)),
                                  budget=SetupBudget(test_timeout_s=2))
    assert failure.stage == "test" and "ran past 2s" in failure.reason
    from training.tasks.autoinstall import InstallRecipe

    slow = InstallRecipe(setup_commands=("sleep 30",), test_command="python3 -m unittest -v", runner="unittest",
                         detected_from=("edited",))
    failure = environment_prepare(backend=backend, source=RepoSource(kind="path", location=str(never)), recipe=slow,
                                  budget=SetupBudget(setup_timeout_s=2))
    assert failure.stage == "install" and "exceeded its budget" in failure.reason and "sleep 30" in failure.log


def test_bug_report_leaves_out_lines_with_the_fixed_text():
    output = "E   AssertionError: return high != 3\nValueError: boom\n"
    report = bug_report(repo_label="r", command="pytest", output=output, failing=["t::a"], hidden=("return high",))
    assert "return high" not in report and "ValueError: boom" in report and "`t::a`" in report


def test_pytest_output_statuses_and_counts_with_and_without_the_rule():
    from training.tasks.testoutput import parse_test_output

    quiet = "..F\nPASSED t.py::a\nPASSED t.py::C::b\nFAILED t.py::c - assert 1 == 2\nERROR t.py::d\n2 failed, 2 passed in 0.1s\n"
    statuses, ran = parse_test_output(quiet)
    assert ran == 4 and statuses == {"t.py::a": "ok", "t.py::C::b": "ok", "t.py::c": "FAIL", "t.py::d": "ERROR"}
    assert parse_test_output("PASSED t.py::a\n==== 1 passed, 1 warning in 2.00s ====\n") == ({"t.py::a": "ok"}, 1)
    assert parse_test_output("collected 0 items\n", runner="pytest") == ({}, None)
