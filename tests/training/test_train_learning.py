"""Slow learning run: SFT on scripted-expert trajectories, then GRPO, on the tiny model (~10 minutes).

Run with:  OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/training/test_train_learning.py -m slow -q
"""

from __future__ import annotations

import pytest

from sandboxes import get_backend
from training.agent.config import AgentLimits
from training.checkpoint import load_checkpoint
from training.engine import EngineConfig
from training.serving import ChatModel
from training.tasks.toy import generate_toy_task
from training.train.loop import LoopConfig, OptimizerConfig
from training.train.rl import RLConfig, rl
from training.train.rollouts import rollouts_collect
from training.train.sft import SFTConfig, sft


@pytest.mark.slow
def test_sft_teaches_the_agent_to_solve_tasks_and_rl_trains_on_mixed_groups(tmp_path):
    # 1. SFT: the tiny model memorises the expert's tool calls for two toy tasks.
    result = sft(SFTConfig(
        run_dir=str(tmp_path / "sft"), expert_tasks=2, max_seq_len=4096,
        loop=LoopConfig(steps=150, batch_size=1, micro_batch_size=1, checkpoint_every=0,
                        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=5)),
    ))
    assert result.history[-1]["loss"] < 0.05

    # 2. Through the real agent loop and sandboxes, at moderate temperature, it now fixes the bugs.
    model, tokenizer, _ = load_checkpoint(result.final_checkpoint)
    chat_model = ChatModel(model, tokenizer, engine_config=EngineConfig(max_batch_size=8))
    try:
        records = rollouts_collect(
            tasks=[generate_toy_task(0), generate_toy_task(1)], group_size=4, backend=get_backend("local"),
            chat_model=chat_model, seed=1,
            limits=AgentLimits(max_turns=5, max_tokens=1200, max_tokens_per_turn=200, context_tokens=4096,
                               temperature=0.5),
        )
    finally:
        chat_model.close()
    assert all(record.valid for record in records)
    assert sum(record.passed for record in records) >= 6, [record.status for record in records]

    # 3. GRPO at temperature 1: groups mix solved and failed rollouts, so there is a learning signal.
    history = rl(RLConfig(
        run_dir=str(tmp_path / "rl"), init_checkpoint=str(result.final_checkpoint), tasks=2, tasks_per_step=2,
        group_size=4, steps=3, max_turns=5, max_tokens_per_turn=200, seed=3,
        optimizer=OptimizerConfig(lr=2e-4, warmup_steps=0, weight_decay=0.0, min_lr_ratio=1.0),
    ))
    assert [m["masked_rollouts"] for m in history] == [0, 0, 0]
    mixed = [m for m in history if m["trained_tokens"] > 0]
    assert mixed, "no step had a group with both solved and failed rollouts"
    assert all(m["logprob_mismatch"] < 1e-3 for m in mixed)
