"""SFT: assistant-only loss masks, trajectory sources (database, JSONL, scripted expert), learning."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command

from sandboxes import get_backend
from sandboxes.tools import openai_tool_schemas
from training.chat_format import render_assistant_completion, render_messages
from training.tasks.toy import generate_toy_task
from training.train.data import IGNORE_INDEX, MaskedExamples
from training.train.loop import TrainConfigError, read_metrics
from training.train.scripted_expert import (
    expert_trajectory_create,
    expert_variant,
    report_check_command,
    toy_expert_policy,
    wrong_fix_sources,
)
from training.train.sft import SFTConfig, load_jsonl_trajectories, tokenize_trajectory


@pytest.fixture(scope="module")
def tokenizer():
    from training.tokenizer import default_tokenizer

    return default_tokenizer(2048)


@pytest.fixture(scope="module")
def expert_run():
    task = generate_toy_task(5)
    return task, expert_trajectory_create(task=task, backend=get_backend("local"))


def test_scripted_expert_solves_toy_task_with_exact_tool_calls(expert_run):
    task, trajectory = expert_run
    assert trajectory.reward == 1.0
    calls = [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for message in trajectory.messages
        if message["role"] == "assistant"
        for call in message.get("tool_calls", [])
    ]
    assert calls == [
        ("read_file", {"path": task.solution.path}),
        ("edit_file", {"path": task.solution.path, "old_str": task.solution.old_text, "new_str": task.solution.new_text}),
        ("run_terminal", {"command": task.test_command}),
    ]
    tool_outputs = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert "Edited" in tool_outputs[1] and "OK" in tool_outputs[2]  # real tool results, tests passing
    assert len(toy_expert_policy(task).turns) == 3


def test_scripted_expert_can_fix_by_line_range():
    task = generate_toy_task(7)
    trajectory = expert_trajectory_create(task=task, backend=get_backend("local"), edit_tool="replace_lines")
    assert trajectory.reward == 1.0
    lines = task.solution.as_line_range(task.files[task.solution.path])
    edit_call = trajectory.messages[4]["tool_calls"][0]["function"]
    assert edit_call["name"] == "replace_lines"
    assert json.loads(edit_call["arguments"]) == {
        "path": task.solution.path, "start_line": lines.start_line, "end_line": lines.end_line,
        "new_text": lines.new_text,
    }
    with pytest.raises(ValueError, match="edit_tool must be one of"):
        toy_expert_policy(task, edit_tool="sed")


def _calls(messages: list[dict]) -> list[tuple[str, dict]]:
    return [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for message in messages
        if message["role"] == "assistant"
        for call in message.get("tool_calls", [])
    ]


def _exec_report_call(source: str, task) -> str:
    namespace: dict = {}
    exec(compile(source, "<test>", "exec"), namespace)
    return repr(eval(task.metadata["report_call"], namespace))


def test_wrong_fixes_change_the_faulty_line_and_keep_the_report_wrong():
    tasks = [generate_toy_task(seed) for seed in range(40)]
    with_wrong = [(task, wrong_fix_sources(task)) for task in tasks]
    assert sum(1 for _, wrong in with_wrong if wrong) >= 20  # most kinds have another change of the line
    for task, wrong in with_wrong:
        fix = task.solution
        buggy = task.files[fix.path]
        fixed = fix.apply(buggy)
        assert _exec_report_call(fixed, task) == task.metadata["report_expected"]  # the report's value is right
        for source in wrong:
            assert source not in (buggy, fixed)
            changed = [i for i, (a, b) in enumerate(zip(buggy.splitlines(), source.splitlines(), strict=True)) if a != b]
            assert len(changed) == 1 and buggy.splitlines()[changed[0]] in fix.old_text
            assert _report_outcome(source, task) != task.metadata["report_expected"]  # a wrong value or a raise
    removed = next(task for task in tasks if task.mutation_kind == "remove_statement")
    assert wrong_fix_sources(removed) == []  # its fix inserts a line: no other change of "that line" exists


def _report_outcome(source: str, task) -> str:
    try:
        return _exec_report_call(source, task)
    except Exception as exc:  # noqa: BLE001  (a wrong fix may raise; that is an outcome here)
        return f"raises {exc!r}"


def test_verifying_expert_checks_the_fix_with_the_report_call():
    task = generate_toy_task(5)
    command = report_check_command(task)
    assert command.startswith("python3 -c ") and task.metadata["report_call"] in command
    # the call is the report's own `pkg.module.call(...)` span, so a policy can copy it whole
    module_call = f"{task.metadata['module'][:-3].replace('/', '.')}.{task.metadata['report_call']}"
    assert f"`{module_call}`" in task.prompt and module_call in command
    trajectory = expert_trajectory_create(task=task, backend=get_backend("local"), verify=True)
    assert trajectory.reward == 1.0
    fix = task.solution
    assert _calls(trajectory.messages) == [
        ("run_terminal", {"command": command}),  # reproduce the bug, in the same turn as the read
        ("read_file", {"path": fix.path}),
        ("edit_file", {"path": fix.path, "old_str": fix.old_text, "new_str": fix.new_text}),
        ("run_terminal", {"command": command}),
    ]
    assert len(trajectory.messages[2]["tool_calls"]) == 2
    outputs = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    expected_line = f"\n{task.metadata['report_expected']}\n"
    assert expected_line not in outputs[0]  # the reproduction shows the bug
    assert expected_line in outputs[-1] and "[exit code 0]" in outputs[-1]
    assert task.metadata["report_expected"] in trajectory.messages[-1]["content"]


def test_retrying_expert_recovers_from_a_wrong_first_fix():
    task = next(t for t in map(generate_toy_task, range(40)) if wrong_fix_sources(t) and t.mutation_kind == "off_by_one")
    wrong = wrong_fix_sources(task)[0]
    trajectory = expert_trajectory_create(task=task, backend=get_backend("local"), verify=True, wrong_first=wrong)
    assert trajectory.reward == 1.0
    calls = _calls(trajectory.messages)
    assert [name for name, _ in calls] == [
        "run_terminal", "read_file", "edit_file", "run_terminal", "edit_file", "run_terminal"
    ]
    buggy = task.files[task.solution.path]
    first, second = calls[2][1], calls[4][1]
    assert buggy.replace(first["old_str"], first["new_str"]) == wrong  # the wrong fix, exactly
    assert wrong.replace(second["old_str"], second["new_str"]) == task.solution.apply(buggy)  # then the right one
    outputs = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    expected_line = f"\n{task.metadata['report_expected']}\n"
    assert expected_line not in outputs[0] and expected_line not in outputs[3] and expected_line in outputs[5]
    with pytest.raises(ValueError, match="needs verify=True"):
        toy_expert_policy(task, wrong_first=wrong)

    # SFT shows the wrong edit as context and trains on the recovery only (with context loss too).
    from training.tokenizer import default_tokenizer

    tokenizer = default_tokenizer(2048)
    assistant = [m for m in trajectory.messages if m["role"] == "assistant"]
    assert [m.get("train", True) for m in assistant] == [True, False, True, True, True, True]
    taught = "".join(render_assistant_completion(m) for m in assistant if m.get("train", True))
    mistake = render_assistant_completion(assistant[1])
    for context_loss in (False, True):
        example = tokenize_trajectory(
            messages=trajectory.messages, tools=openai_tool_schemas(), tokenizer=tokenizer, context_loss=context_loss
        )
        trained = tokenizer.decode([t for t, keep in zip(example.token_ids, example.trainable, strict=True) if keep])
        assert mistake not in trained
        if not context_loss:
            assert trained == taught


def test_expert_variant_draws_a_stable_share_of_retries():
    tasks = [generate_toy_task(seed) for seed in range(60)]
    eligible = [task for task in tasks if wrong_fix_sources(task)]
    assert all(expert_variant(task, retry_share=0.0) is None for task in tasks)
    assert all(expert_variant(task, retry_share=1.0) in wrong_fix_sources(task) for task in eligible)
    half = [expert_variant(task, retry_share=0.5) for task in eligible]
    assert half == [expert_variant(task, retry_share=0.5) for task in eligible]  # seeded by the task
    assert 0.25 * len(eligible) < sum(variant is not None for variant in half) < 0.75 * len(eligible)
    with pytest.raises(ValueError, match="retry_share"):
        expert_variant(tasks[0], retry_share=1.5)


def test_loss_mask_covers_exactly_the_assistant_completions(expert_run, tokenizer):
    _, trajectory = expert_run
    tools = openai_tool_schemas()
    example = tokenize_trajectory(messages=trajectory.messages, tools=tools, tokenizer=tokenizer)
    assert tokenizer.decode(example.token_ids) == render_messages(trajectory.messages, tools, add_generation_prompt=False)
    trained = tokenizer.decode([t for t, keep in zip(example.token_ids, example.trainable, strict=True) if keep])
    expected = "".join(render_assistant_completion(m) for m in trajectory.messages if m["role"] == "assistant")
    assert trained == expected
    # Tool outputs and the system/user prompt are never trained on.
    context = tokenizer.decode([t for t, keep in zip(example.token_ids, example.trainable, strict=True) if not keep])
    assert "Ran 18 tests" in context or "OK" in context

    batch = MaskedExamples(examples=[example], pad_id=tokenizer.pad_id, max_seq_len=8192, seed=0).batch(start=0, size=1)
    target_positions = batch.targets[0] != IGNORE_INDEX
    assert int(target_positions.sum()) == sum(example.trainable[1:])
    assert tokenizer.decode(batch.targets[0][target_positions].tolist()) == expected


def test_context_loss_adds_user_and_tool_text_but_never_the_system_turn(expert_run, tokenizer):
    task, trajectory = expert_run
    tools = openai_tool_schemas()
    plain = tokenize_trajectory(messages=trajectory.messages, tools=tools, tokenizer=tokenizer)
    example = tokenize_trajectory(messages=trajectory.messages, tools=tools, tokenizer=tokenizer, context_loss=True)
    assert example.token_ids == plain.token_ids
    trained = tokenizer.decode([t for t, keep in zip(example.token_ids, example.trainable, strict=True) if keep])
    untrained = tokenizer.decode([t for t, keep in zip(example.token_ids, example.trainable, strict=True) if not keep])
    system = render_messages(trajectory.messages[:1], tools, add_generation_prompt=False)
    assert trajectory.messages[0]["role"] == "system" and untrained.startswith(system)
    assert "read_file(path: string" in untrained and "read_file(path: string" not in trained
    assert task.prompt in trained  # the bug report, with its package name twice
    assert "OK" in trained  # the test run's output
    for message in trajectory.messages:
        if message["role"] == "assistant":
            assert render_assistant_completion(message) in trained
    # Besides the system turn only the newline closing the final assistant turn stays untrained.
    assert untrained == system + "\n"


def test_jsonl_source_and_config_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    good.write_text(json.dumps(messages) + "\n\n" + json.dumps({"messages": messages}) + "\n")
    assert load_jsonl_trajectories(good) == [messages, messages]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": "nope"}\n')
    with pytest.raises(TrainConfigError, match="bad.jsonl:1"):
        load_jsonl_trajectories(bad)
    with pytest.raises(TrainConfigError, match="SFT has no data"):
        SFTConfig(run_dir=str(tmp_path / "run"))
    with pytest.raises(TrainConfigError, match="does not exist"):
        SFTConfig(run_dir=str(tmp_path / "run"), jsonl_files=(str(tmp_path / "missing.jsonl"),))


@pytest.mark.django_db
def test_sft_command_learns_recorded_expert_rollouts_from_database(expert_run, owner, tmp_path):
    """The recorded rollout goes through the agents app's store and selector into `manage.py sft`."""
    from training.agent.config import AgentLimits
    from training.agent.loop import run_agent
    from training.tasks.sandboxing import task_sandboxes_create
    from webapp.agents.services import rollout_record

    task, _ = expert_run
    sandbox = task_sandboxes_create(backend=get_backend("local"), task=task)[0]
    try:
        result = run_agent(sandbox=sandbox, policy=toy_expert_policy(task), prompt=task.prompt, limits=AgentLimits())
    finally:
        sandbox.destroy()
    rollout_record(owner=owner, result=result, prompt=task.prompt, experiment_name="sft-test",
                   repo_label=task.task_id, model_name="scripted-expert", reward=1.0)
    # A failed rollout (reward 0) must not be learned from.
    rollout_record(owner=owner, result=result, prompt=task.prompt, experiment_name="sft-test",
                   repo_label=task.task_id, model_name="scripted-expert", reward=0.0)

    run_dir = tmp_path / "sft"
    call_command(
        "sft", "--run-dir", str(run_dir), "--database-limit", "10", "--steps", "14", "--batch-size", "1",
        "--lr", "3e-3", "--warmup-steps", "1", "--checkpoint-every", "0", "--max-seq-len", "4096",
    )
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 15))
    assert metrics[0]["tokens"] > 100  # assistant tokens only: a few hundred, not the ~4k of the whole trajectory
    assert metrics[0]["tokens"] < 1000
    first, last = metrics[0]["loss"], min(m["loss"] for m in metrics[-3:])
    assert last < 0.7 * first, (first, last)
    checkpoint = run_dir / "checkpoints" / "step-00000014"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["run_config"]["trajectories"] == 1


def test_expert_trajectories_command_writes_sft_jsonl_and_resumes(tmp_path):
    output = tmp_path / "expert.jsonl"
    call_command("expert_trajectories", count=1, output=str(output), sandbox_backend="local")
    call_command("expert_trajectories", count=2, output=str(output), sandbox_backend="local")
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [record["task_id"] for record in records] == ["toy-0", "toy-1"]  # the first one is not redone
    assert load_jsonl_trajectories(output) == [record["messages"] for record in records]
    assert records[1]["messages"][1]["content"] == generate_toy_task(1).prompt


def test_expert_trajectories_command_rejects_a_foreign_file(tmp_path):
    from django.core.management.base import CommandError

    output = tmp_path / "notes.jsonl"
    output.write_text("not json\n")
    with pytest.raises(CommandError, match="is not a trajectory line"):
        call_command("expert_trajectories", count=1, output=str(output), sandbox_backend="local")


def test_expert_trajectories_command_records_verified_and_retried_runs(tmp_path):
    from django.core.management.base import CommandError

    output = tmp_path / "verify.jsonl"
    with pytest.raises(CommandError, match="--retry-share needs --verify"):
        call_command("expert_trajectories", count=1, output=str(output), retry_share=0.5)
    call_command("expert_trajectories", count=6, output=str(output), sandbox_backend="local", verify=True,
                 retry_share=1.0)
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == 6
    for record in records:
        task = generate_toy_task(int(record["task_id"].removeprefix("toy-")))
        names = [name for name, _ in _calls(record["messages"])]
        assert record["retry"] == bool(wrong_fix_sources(task))
        direct = ["run_terminal", "read_file", "edit_file", "run_terminal"]
        assert names == (direct + ["edit_file", "run_terminal"] if record["retry"] else direct)
    assert any(record["retry"] for record in records)

    # A task whose report call cannot be written into the check command is skipped, not recorded otherwise.
    unsafe = next(seed for seed in range(400) if report_check_command(generate_toy_task(seed)) is None)
    skipped = tmp_path / "skipped.jsonl"
    out = io.StringIO()
    call_command("expert_trajectories", count=1, start=unsafe, output=str(skipped), sandbox_backend="local",
                 verify=True, stdout=out)
    assert skipped.read_text() == "" and "1 skipped (no report call to check with)" in out.getvalue()
