"""The demo model shipped in models/demo is what `make run` serves; it must load and act on a task."""

from __future__ import annotations

import json
from pathlib import Path

from sandboxes import get_backend
from training.agent.config import AgentLimits
from training.agent.loop import run_agent
from training.serving import ChatModel
from training.tasks.sandboxing import task_sandboxes_create
from training.tasks.toy import generate_toy_task, toy_task_seeds
from training.train.rollouts import LocalModelPolicy

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


def test_make_run_serves_the_shipped_demo_model():
    import scripts.run as run

    assert run.DEMO_MODEL == DEMO and (DEMO / "model.safetensors").is_file()


def test_demo_model_opens_the_buggy_file_of_a_held_out_task():
    model = ChatModel.load(str(DEMO))
    task = generate_toy_task(toy_task_seeds(split="heldout", count=1)[0])
    (sandbox,) = task_sandboxes_create(backend=get_backend("local"), task=task)
    try:
        result = run_agent(
            sandbox=sandbox,
            policy=LocalModelPolicy(model, seed=0),
            prompt=task.prompt,
            limits=AgentLimits(max_turns=1, max_tokens=512, max_tokens_per_turn=256, temperature=0.0, top_p=1.0),
        )
    finally:
        sandbox.destroy()
        model.close()
    first_call = result.messages[2]["tool_calls"][0]["function"]
    assert first_call["name"] == "read_file"
    assert json.loads(first_call["arguments"]) == {"path": task.solution.path}
