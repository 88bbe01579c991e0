"""Toy tier: deterministic generation, fail-to-pass by construction, reference fix and rewards."""

from __future__ import annotations

import collections
import subprocess
import sys

import pytest

from training.tasks.base import CodingTask, FileEdit, LineEdit, TaskError, minimal_fix_edit
from training.tasks.mutations import MUTATION_KINDS, MutationError, enumerate_mutations
from training.tasks.reward import (
    RewardConfig,
    RewardInfrastructureError,
    parse_unittest_output,
    reference_edit_similarity,
    score_rollout,
)
from training.tasks.sandboxing import task_sandboxes_create
from training.tasks.toy import HELDOUT_SEED_OFFSET, generate_toy_task, toy_task_seeds


def _run_hidden_tests(task: CodingTask, files: dict[str, str], tmp_path) -> dict[str, str]:
    root = tmp_path / "repo"
    for path, text in {**files, **task.hidden_tests}.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    done = subprocess.run(
        check=False,
        args=task.test_command.replace("python3", sys.executable),
        shell=True,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    statuses, ran = parse_unittest_output(done.stdout + done.stderr)
    assert ran == len(statuses), done.stderr[-2000:]
    return statuses


def test_same_seed_same_task_and_seeds_differ():
    assert generate_toy_task(42) == generate_toy_task(42)
    assert generate_toy_task(42).to_json() == generate_toy_task(42).to_json()
    assert generate_toy_task(42).files != generate_toy_task(43).files
    assert CodingTask.from_json(generate_toy_task(5).to_json()) == generate_toy_task(5)


def test_thousands_of_tasks_cover_every_mutation_kind_and_are_distinct():
    tasks = [generate_toy_task(seed) for seed in range(1500)]
    kinds = collections.Counter(task.mutation_kind for task in tasks)
    assert set(kinds) == set(MUTATION_KINDS), kinds
    fingerprints = {tuple(sorted(task.files.items())) for task in tasks}
    assert len(fingerprints) > 1450
    assert all(task.split == "train" and task.fail_to_pass for task in tasks)


def test_heldout_seeds_are_disjoint_from_train():
    train = toy_task_seeds(split="train", count=100)
    heldout = toy_task_seeds(split="heldout", count=100)
    assert not set(train) & set(heldout)
    assert generate_toy_task(heldout[0]).split == "heldout" and heldout[0] >= HELDOUT_SEED_OFFSET
    with pytest.raises(TaskError, match="split must be"):
        toy_task_seeds(split="test", count=1)
    with pytest.raises(TaskError, match="non-negative"):
        generate_toy_task(-1)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 11, HELDOUT_SEED_OFFSET + 4])
def test_hidden_tests_fail_with_bug_and_pass_with_reference_fix(seed, tmp_path):
    task = generate_toy_task(seed)
    buggy = _run_hidden_tests(task, task.files, tmp_path / "buggy")
    assert {test for test, status in buggy.items() if status != "ok"} == set(task.fail_to_pass)
    fixed = _run_hidden_tests(task, task.solved_files(), tmp_path / "fixed")
    assert set(fixed) == set(task.fail_to_pass) | set(task.pass_to_pass)
    assert all(status == "ok" for status in fixed.values())
    # The agent never sees the tests of the buggy function.
    function = task.metadata["function"]
    assert not any(
        f"def test_{function}_" in text for path, text in task.files.items() if path.startswith("tests/")
    )


def test_minimal_fix_edit_is_unique_and_reverts_the_bug():
    buggy = "x = 1\ny = 2\nx = 1\nz = 3\n"
    fixed = "x = 1\ny = 2\nx = 2\nz = 3\n"
    edit = minimal_fix_edit(path="a.py", buggy=buggy, fixed=fixed)
    assert buggy.count(edit.old_text) == 1 and edit.apply(buggy) == fixed
    with pytest.raises(TaskError, match="occurs 0 times"):
        FileEdit(path="a.py", old_text="nope", new_text="").apply(buggy)


def test_line_range_fix_rewrites_only_the_changed_lines():
    buggy = "def f(a):\n    # a comment line\n    x = a + 1\n    return a\n"
    changed = FileEdit(path="a.py", old_text="    return a\n", new_text="    return x\n")
    assert changed.as_line_range(buggy) == LineEdit(path="a.py", start_line=4, end_line=4, new_text="    return x\n")
    # A removed statement put back: the range also rewrites the shorter neighbouring line.
    inserted = FileEdit(path="a.py", old_text="    x = a + 1\n", new_text="    x = a + 1\n    x *= 2\n")
    edit = inserted.as_line_range(buggy)
    assert (edit.start_line, edit.end_line) == (4, 4) and edit.new_text == "    x *= 2\n    return a\n"
    for seed in range(40):
        task = generate_toy_task(seed)
        source = task.files[task.solution.path]
        edit = task.solution.as_line_range(source)
        assert edit.apply(source) == task.solution.apply(source)
        assert edit.end_line - edit.start_line + 1 == 1


def test_mutations_are_single_site_and_compile():
    source = "def f(a, b):\n    # keep me\n    if a < b:\n        return max(a, b) + 1\n    total = a - b\n    return total\n"
    mutations = enumerate_mutations(source, path="m.py")
    kinds = {mutation.kind for mutation in mutations}
    assert {
        "compare_swap",
        "operator_swap",
        "off_by_one",
        "negate_condition",
        "swap_arguments",
        "remove_guard",
        "remove_statement",
    } <= kinds
    for mutation in mutations:
        assert "# keep me" in mutation.mutated_source
        compile(mutation.mutated_source, "m.py", "exec")
    with pytest.raises(MutationError, match="does not parse"):
        enumerate_mutations("def (:", path="bad.py")


def test_reward_scores_buggy_zero_and_fixed_one_in_a_sandbox(task_backend):
    task = generate_toy_task(3)
    buggy_box, fixed_box = task_sandboxes_create(backend=task_backend, task=task, count=2)
    try:
        fixed_box.write_bytes(
            task.solution.path, task.solution.apply(task.files[task.solution.path]).encode()
        )
        # Tampering with the tests does not help: hidden tests are written over them.
        for path in task.hidden_tests:
            buggy_box.write_bytes(path, b"")
        buggy = score_rollout(sandbox=buggy_box, task=task)
        fixed = score_rollout(sandbox=fixed_box, task=task)
    finally:
        buggy_box.destroy()
        fixed_box.destroy()
    assert (buggy.value, buggy.passed, buggy.fail_to_pass_passed) == (0.0, False, 0)
    assert buggy.tests_total == len(task.fail_to_pass) + len(task.pass_to_pass)
    assert (fixed.value, fixed.passed) == (1.0, True)
    assert fixed.fail_to_pass_passed == len(task.fail_to_pass)


def test_partial_credit_lint_and_format_terms(task_backend):
    task = generate_toy_task(3)
    fixed_files = task.solved_files()
    sloppy = fixed_files[task.solution.path] + "\nimport os\ndef  unused ( ):\n    return   1\n"
    box, buggy_box = task_sandboxes_create(backend=task_backend, task=task, count=2)
    try:
        box.write_bytes(task.solution.path, sloppy.encode())
        styled = score_rollout(
            sandbox=box, task=task, config=RewardConfig(lint_weight=0.1, format_weight=0.05)
        )
        partial = score_rollout(sandbox=buggy_box, task=task, config=RewardConfig(partial_credit=True))
    finally:
        box.destroy()
        buggy_box.destroy()
    assert styled.passed and styled.lint_penalty == 0.1 and styled.format_penalty == 0.05
    assert styled.value == pytest.approx(0.85)
    expected = len(task.pass_to_pass) / (len(task.pass_to_pass) + len(task.fail_to_pass))
    assert partial.value == pytest.approx(expected) and not partial.passed
    with pytest.raises(TaskError, match="must be <= 1"):
        RewardConfig(lint_weight=0.8, format_weight=0.5)


def _near_miss_edit(task: CodingTask) -> dict:
    """The reference fix with one character of its old text changed: the copy misses, the target is right."""
    old = task.solution.old_text
    position = next(index for index, char in enumerate(old) if char.isalnum())
    changed = old[:position] + ("x" if old[position] != "x" else "y") + old[position + 1 :]
    return {"path": task.solution.path, "old_str": changed, "new_str": task.solution.new_text}


def test_reference_similarity_ranks_near_misses_above_wrong_lines():
    task = generate_toy_task(3)
    exact = {"path": task.solution.path, "old_str": task.solution.old_text, "new_str": task.solution.new_text}
    near = _near_miss_edit(task)
    other_line = {"path": task.solution.path, "old_str": "    return None\n", "new_str": "    return 0\n"}
    assert reference_edit_similarity(task=task, edit_arguments=[exact]) == pytest.approx(1.0)
    near_score = reference_edit_similarity(task=task, edit_arguments=[near])
    far_score = reference_edit_similarity(task=task, edit_arguments=[other_line])
    assert 0.8 < near_score < 1.0 and far_score < near_score
    # The closest call counts; other files, "./" spellings and malformed arguments are handled.
    assert reference_edit_similarity(task=task, edit_arguments=[other_line, near]) == pytest.approx(near_score)
    assert reference_edit_similarity(task=task, edit_arguments=[{**exact, "path": "elsewhere.py"}]) == 0.0
    dotted = {**exact, "path": "./" + task.solution.path}
    assert reference_edit_similarity(task=task, edit_arguments=[dotted]) == pytest.approx(1.0)
    malformed = [{"path": task.solution.path, "old_str": 3, "new_str": "x"}, {"path": "../../etc/passwd", "old_str": "a",
                                                                               "new_str": "b"}]
    assert reference_edit_similarity(task=task, edit_arguments=malformed) == 0.0
    assert reference_edit_similarity(task=task, edit_arguments=[]) == 0.0


def test_reference_similarity_shapes_failures_only(task_backend):
    task = generate_toy_task(3)
    config = RewardConfig(reference_similarity_weight=0.3)
    near = _near_miss_edit(task)
    failed_box, fixed_box, hanging_box = task_sandboxes_create(backend=task_backend, task=task, count=3)
    try:
        fixed_box.write_bytes(task.solution.path, task.solved_files()[task.solution.path].encode())
        hang = task.files[task.solution.path] + "\nimport time\ntime.sleep(60)\n"
        hanging_box.write_bytes(task.solution.path, hang.encode())
        failed = score_rollout(sandbox=failed_box, task=task, config=config, edit_arguments=[near])
        fixed = score_rollout(sandbox=fixed_box, task=task, config=config, edit_arguments=[near])
        hanging = score_rollout(
            sandbox=hanging_box, task=task, config=RewardConfig(reference_similarity_weight=0.3, timeout_s=2),
            edit_arguments=[near],
        )
        unshaped = score_rollout(sandbox=failed_box, task=task, edit_arguments=[near])
    finally:
        for box in (failed_box, fixed_box, hanging_box):
            box.destroy()
    similarity = reference_edit_similarity(task=task, edit_arguments=[near])
    assert not failed.passed and failed.value == pytest.approx(0.3 * similarity) and failed.value > 0.2
    assert failed.reference_similarity == pytest.approx(similarity)
    # A pass scores 1 whatever its edits looked like; a hang scores 0; without the weight nothing changes.
    assert fixed.passed and fixed.value == 1.0
    assert hanging.timed_out and hanging.value == 0.0
    assert unshaped.value == 0.0 and unshaped.reference_similarity is None
    with pytest.raises(TaskError, match="reference_similarity_weight must be in"):
        RewardConfig(reference_similarity_weight=1.0)
    with pytest.raises(TaskError, match="reference_similarity_weight must be in"):
        RewardConfig(reference_similarity_weight=-0.1)


def test_hanging_fix_scores_zero_but_dead_sandbox_is_infrastructure(task_backend):
    task = generate_toy_task(3)
    box, dead = task_sandboxes_create(backend=task_backend, task=task, count=2)
    try:
        hang = task.files[task.solution.path] + "\nimport time\ntime.sleep(60)\n"
        box.write_bytes(task.solution.path, hang.encode())
        reward = score_rollout(sandbox=box, task=task, config=RewardConfig(timeout_s=2))
        assert reward.timed_out and reward.value == 0.0
        dead.destroy()
        with pytest.raises(RewardInfrastructureError):
            score_rollout(sandbox=dead, task=task)
    finally:
        box.destroy()


def test_parse_unittest_output_handles_docstring_lines():
    text = (
        "test_a (tests.test_x.TestX.test_a) ... ok\n"
        "test_b (tests.test_x.TestX.test_b)\nDoes b. ... FAIL\n"
        "test_c (tests.test_x.TestX.test_c) ... skipped 'no'\n"
        "----\nRan 3 tests in 0.001s\n\nFAILED (failures=1)\n"
    )
    statuses, ran = parse_unittest_output(text)
    assert ran == 3
    assert statuses == {
        "tests.test_x.TestX.test_a": "ok",
        "tests.test_x.TestX.test_b": "FAIL",
        "tests.test_x.TestX.test_c": "skipped",
    }


def test_rollout_rewards_see_every_edit_file_call_the_agent_made(task_backend):
    """The shaping term reads the edit_file calls from the agent loop's own events: rejected ones count
    (a near-miss copy is what it ranks), other tools and unparseable arguments do not."""
    from training.agent.config import AgentLimits
    from training.agent.loop import run_agent
    from training.agent.scripted import ScriptedExpertPolicy, ScriptedTurn
    from training.rollout.driver import _edit_file_arguments

    task = generate_toy_task(3)
    near = {"path": task.solution.path, "old_str": task.solution.old_text.replace(" ", "  ", 1),
            "new_str": task.solution.new_text}
    policy = ScriptedExpertPolicy(
        turns=[
            ScriptedTurn(content="look", calls=(("read_file", {"path": task.solution.path}),)),
            ScriptedTurn(content="fix", calls=(("edit_file", near),)),
        ],
        final_message="done",
    )
    (sandbox,) = task_sandboxes_create(backend=task_backend, task=task)
    try:
        result = run_agent(sandbox=sandbox, policy=policy, prompt=task.prompt, limits=AgentLimits(max_turns=4))
        rejected = [e for e in result.events if e["kind"] == "tool_result" and not e["payload"]["ok"]]
        arguments = _edit_file_arguments(result.events)
        reward = score_rollout(sandbox=sandbox, task=task, config=RewardConfig(reference_similarity_weight=0.3),
                               edit_arguments=arguments)
    finally:
        sandbox.destroy()
    assert len(rejected) == 1 and arguments == [near]
    similarity = reference_edit_similarity(task=task, edit_arguments=[near])
    assert not reward.passed and reward.value == pytest.approx(0.3 * similarity) and similarity > 0.9
    events = [{"kind": "tool_call", "payload": {"name": "edit_file", "arguments": "{not json"}},
              {"kind": "tool_call", "payload": {"name": "grep", "arguments": {"pattern": "x"}}}]
    assert _edit_file_arguments(events) == []
