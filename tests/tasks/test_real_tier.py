"""Real tier: stdlib bugs validated fail-to-pass in the local sandbox, split by module, deduplicated."""

from __future__ import annotations

import pytest

from sandboxes import get_backend
from training.tasks.base import TaskError
from training.tasks.real import RealTierConfig, mine_stdlib_tasks, module_split, stdlib_repository
from training.tasks.reward import score_rollout
from training.tasks.sandboxing import task_sandboxes_create


@pytest.fixture(scope="module")
def mined():
    config = RealTierConfig(
        modules=("bisect", "no_such_module"), candidates_per_module=3, seed=1, test_timeout_s=10
    )
    return mine_stdlib_tasks(config=config, backend=get_backend("local"))


def test_stdlib_test_suite_is_available():
    files, test_module = stdlib_repository("bisect")
    assert test_module == "test_bisect" and "def bisect_left" in files["bisect.py"]
    with pytest.raises(TaskError, match="not a single-file"):
        stdlib_repository("no_such_module")


def test_kept_tasks_are_fail_to_pass_and_the_reference_fix_scores_one(mined):
    assert mined.tasks, mined.rejected
    assert any(item["module"] == "no_such_module" for item in mined.rejected)
    task = mined.tasks[0]
    assert task.tier == "real" and task.split == module_split("bisect") and task.fail_to_pass
    assert not set(task.fail_to_pass) & set(task.pass_to_pass)
    buggy, fixed = task_sandboxes_create(backend=get_backend("local"), task=task, count=2)
    try:
        fixed.write_bytes(task.solution.path, task.solved_files()[task.solution.path].encode())
        assert score_rollout(sandbox=buggy, task=task).value == 0.0
        reward = score_rollout(sandbox=fixed, task=task)
    finally:
        buggy.destroy()
        fixed.destroy()
    assert reward.passed and reward.value == 1.0 and reward.fail_to_pass_passed == len(task.fail_to_pass)


def test_mining_again_skips_known_bugs_and_split_is_by_module(mined):
    known = frozenset(task.task_id.rsplit("-", 1)[1] for task in mined.tasks)
    config = RealTierConfig(modules=("bisect",), candidates_per_module=3, seed=1, test_timeout_s=10)
    again = mine_stdlib_tasks(config=config, backend=get_backend("local"), known_fingerprints=known)
    assert not {task.task_id for task in again.tasks} & {task.task_id for task in mined.tasks}
    assert {item["reason"] for item in again.rejected} >= {"duplicate"}
    splits = {
        module: module_split(module) for module in ("bisect", "colorsys", "shlex", "textwrap", "difflib")
    }
    assert set(splits.values()) == {"train", "heldout"}
    with pytest.raises(TaskError, match="split must be"):
        RealTierConfig(split="test")
