"""Continued pretraining: learns on the offline corpus, continues from a checkpoint, reads extra repos."""

from __future__ import annotations

import pytest

from training.train.distributed import DistributedContext
from training.train.loop import LoopConfig, OptimizerConfig, TrainConfigError
from training.train.pretrain import PretrainConfig, pretrain


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from training.tokenizer import default_tokenizer

    return str(default_tokenizer(2048).save(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"))


def _loop(steps: int) -> LoopConfig:
    return LoopConfig(steps=steps, batch_size=4, micro_batch_size=4, checkpoint_every=0,
                      optimizer=OptimizerConfig(lr=3e-3, warmup_steps=2))


def test_pretraining_learns_and_continues_from_its_checkpoint(tmp_path, tokenizer_file):
    first = pretrain(PretrainConfig(run_dir=str(tmp_path / "a"), tokenizer=tokenizer_file, seq_len=64,
                                    corpus_max_bytes=60_000, loop=_loop(25)))
    losses = [m["loss"] for m in first.history]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0  # next-token loss falls well below its start
    assert all(m["load_balancing_loss"] > 0 and m["router_z_loss"] > 0 for m in first.history)

    continued = pretrain(PretrainConfig(run_dir=str(tmp_path / "b"), init_checkpoint=str(first.final_checkpoint),
                                        seq_len=64, corpus_max_bytes=60_000, loop=_loop(1)))
    # Starting from the trained weights, the first step's loss is near where the first run ended.
    assert continued.history[0]["loss"] < losses[0] - 1.0


def test_registered_repository_is_the_corpus(tmp_path, tokenizer_file):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "mod.py").write_text("def add(a, b):\n    return a + b\n" * 200)
    result = pretrain(PretrainConfig(run_dir=str(tmp_path / "run"), tokenizer=tokenizer_file, seq_len=32,
                                     extra_dirs=(str(repo),), include_stdlib=False, loop=_loop(12)))
    # A repetitive 1-file corpus is learned almost perfectly in a few steps.
    assert result.history[-1]["loss"] < 0.5 * result.history[0]["loss"]


def test_config_errors_say_how_to_fix(tmp_path, tokenizer_file):
    with pytest.raises(TrainConfigError, match="drop tokenizer"):
        PretrainConfig(run_dir=str(tmp_path), init_checkpoint="x", tokenizer=tokenizer_file)
    with pytest.raises(TrainConfigError, match="multiple of 4"):
        LoopConfig(batch_size=6, micro_batch_size=4).validate_for(DistributedContext(world_size=1))


def test_induction_windows_hold_only_copies_an_induction_head_can_predict():
    import torch

    from training.train.data import IGNORE_INDEX, InductionSequences

    data = InductionSequences(vocab_size=2048, first_token_id=8, seq_len=256, seed=3)
    batch = data.batch(start=0, size=4)
    assert batch.input_ids.shape == batch.targets.shape == (4, 256)
    assert int(batch.input_ids.min()) >= 8  # never a special token
    assert torch.equal(data.batch(start=2, size=2).targets, batch.targets[2:])  # a pure function of the index
    assert not torch.equal(InductionSequences(vocab_size=2048, first_token_id=8, seq_len=256, seed=4).batch(
        start=0, size=4).input_ids, batch.input_ids)
    for row in range(4):
        tokens = batch.input_ids[row].tolist()
        trained = [t for t in range(256) if batch.targets[row, t] != IGNORE_INDEX]
        assert len(trained) > 40  # a dense copy signal
        for t in trained:
            # The current token occurred earlier, followed by exactly the target.
            target = int(batch.targets[row, t])
            earlier = [j for j in range(t) if tokens[j] == tokens[t] and (tokens + [None])[j + 1] == target]
            assert earlier, f"row {row} position {t} is not a copy"


def test_induction_warm_up_config_errors(tmp_path, tokenizer_file):
    with pytest.raises(TrainConfigError, match="choose 'code'"):
        PretrainConfig(run_dir=str(tmp_path), data="random")
    with pytest.raises(TrainConfigError, match="at least 64"):
        PretrainConfig(run_dir=str(tmp_path), data="induction", seq_len=32)


def test_induction_warm_up_trains_through_the_pretraining_loop(tmp_path, tokenizer_file):
    result = pretrain(PretrainConfig(run_dir=str(tmp_path / "run"), tokenizer=tokenizer_file, data="induction",
                                     seq_len=64, loop=_loop(3)))
    assert len(result.history) == 3 and result.final_checkpoint.is_dir()
    assert result.history[0]["tokens"] < 4 * 64  # the loss covers the repeated runs only
