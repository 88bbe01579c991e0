"""GPUs for the RL run's learner and inference actors, requested through Ray (AsyncRLConfig.learner_gpus /
inference_gpus), on this CPU-only machine: hostile counts refused, a run asking for more GPUs than its cluster
has refused at start instead of waiting forever, an actor given (logical) GPUs whose torch has no CUDA failing
with that reason, and the learner actor computing exactly what the in-process learner computes."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from training.devices import DeviceError, gpu_request_problem
from training.rollout.config import AsyncRLConfig, AsyncRLConfigError
from training.train.learner import Learner
from training.train.loop import OptimizerConfig
from training.train.rl import RLConfig
from training.train.rollouts import RolloutRecord, Segment

ray = pytest.importorskip("ray")


@pytest.mark.parametrize("value", [-1, math.nan, math.inf, -math.inf, 1.5, 9, "1", True, None, 1e308])
def test_hostile_gpu_counts_are_refused_by_name(policy_checkpoint, tmp_path, value):
    for name in ("learner_gpus", "inference_gpus"):
        with pytest.raises(AsyncRLConfigError, match=name):
            AsyncRLConfig(run_dir=str(tmp_path), init_checkpoint=policy_checkpoint, **{name: value})


def test_fractions_of_one_gpu_and_whole_gpus_are_accepted():
    for value in (0, 0.25, 0.5, 1, 2, 8, 2.0):
        assert gpu_request_problem("learner_gpus", value) is None


@pytest.fixture
def logical_gpu_ray():
    """A private Ray that declares one GPU this machine does not have (Ray assigns it; torch sees no CUDA)."""
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


def _config(policy_checkpoint, tmp_path, **overrides) -> AsyncRLConfig:
    values = dict(run_dir=str(tmp_path / "run"), init_checkpoint=policy_checkpoint, steps=1, tasks=2, group_size=2,
                  groups_per_step=1, rollout_workers=1, max_turns=1, max_tokens_per_turn=8, sandbox_backend="local")
    return AsyncRLConfig(**{**values, **overrides})


def test_a_run_asking_for_more_gpus_than_its_cluster_has_is_refused_at_start(policy_checkpoint, tmp_path):
    """The driver's own Ray on this machine has no GPU: asking for one fails before any actor waits on it, names
    both numbers, and leaves no Ray running."""
    from training.rollout.driver import run_async_rl

    with pytest.raises(DeviceError, match=r"asks Ray for 1 GPU\(s\) .* the cluster has 0"):
        run_async_rl(_config(policy_checkpoint, tmp_path, learner_gpus=1))
    assert not ray.is_initialized()
    with pytest.raises(DeviceError, match=r"asks Ray for 1\.5 GPU\(s\) \(learner 0 \+ 3 inference actors x 0\.5\)"):
        run_async_rl(_config(policy_checkpoint, tmp_path, inference_gpus=0.5, inference_actors=3, rollout_workers=3))
    assert not ray.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure of a GPU actor without CUDA")
def test_a_learner_given_a_gpu_without_cuda_fails_with_the_reason(logical_gpu_ray, policy_checkpoint, tmp_path):
    from training.rollout.driver import run_async_rl

    with pytest.raises(Exception, match=r"learner asked for 1 GPU\(s\) and Ray assigned it .*sees no CUDA device"):
        run_async_rl(_config(policy_checkpoint, tmp_path, learner_gpus=1))
    assert ray.is_initialized()  # the caller's Ray is the caller's to stop


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure of a GPU actor without CUDA")
def test_an_inference_actor_given_a_gpu_without_cuda_fails_the_run_with_the_reason(logical_gpu_ray, policy_checkpoint,
                                                                                   tmp_path):
    from training.rollout.driver import run_async_rl

    with pytest.raises(Exception, match=r"inference actor asked for 1 GPU\(s\).*sees no CUDA device"):
        run_async_rl(_config(policy_checkpoint, tmp_path, inference_gpus=1))


def _records(policy_checkpoint) -> list[RolloutRecord]:
    """Two groups of synthetic rollouts (random tokens and routing, recorded logprobs) of the tiny policy."""
    from training.checkpoint import load_checkpoint

    model, _, _ = load_checkpoint(policy_checkpoint)
    config = model.config
    generator = torch.Generator().manual_seed(3)

    def tokens(count):
        return torch.randint(3, config.vocab_size, (count,), generator=generator).tolist()

    records = []
    for index in range(4):
        prompt, completion = tokens(20 + index), tokens(6)
        routing = torch.randint(0, config.n_experts, (len(prompt) + len(completion) - 1, config.n_layers, config.top_k),
                                generator=generator)
        segment = Segment(prompt, completion, [-2.0 - 0.1 * index] * len(completion), routing)
        records.append(RolloutRecord(task_id=f"t{index // 2}", group=index // 2, valid=True, reward=float(index % 2),
                                     passed=bool(index % 2), segments=[segment]))
    return records


def test_the_learner_actor_updates_saves_and_restores_as_the_in_process_learner(policy_checkpoint, tmp_path):
    """The same records through the Ray learner actor (on the CPU here) and the in-process Learner: the same
    update statistics, the same weights after two updates, and a checkpoint the other side restores exactly."""
    from training.rollout.learner_actor import RemoteLearner

    def rl_config(run_dir):
        return RLConfig(run_dir=str(run_dir), init_checkpoint=policy_checkpoint, temperature=1.0, routing_replay=True,
                        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0))

    records = _records(policy_checkpoint)
    local = Learner(rl_config(tmp_path / "local"))
    local.restore(tmp_path / "local")
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        remote = RemoteLearner(rl_config(tmp_path / "remote"), gpus=0, time_fraction=lambda: 0.0)
        assert remote.description["device"] == "cpu" and remote.uses_hf_tokenizer is False
        assert remote.restore(tmp_path / "remote") is None
        for _ in range(2):
            expected, got = local.update(records), remote.update(records)
            assert got.advantages == expected.advantages and got.lr == expected.lr
            assert got.stats["trained_tokens"] == expected.stats["trained_tokens"] > 0
            assert got.stats["loss"] == pytest.approx(expected.stats["loss"], abs=1e-6)
        remote_weights = remote.weights()
        assert all(tensor.device.type == "cpu" for tensor in remote_weights.values())
        # Two Adam steps at lr 1e-3 move weights by ~2e-3; the actor's process sums in another thread count, and
        # Adam's g / sqrt(v) magnifies that rounding where a gradient is near 0 (seen: 1.4e-6 on one element).
        for name, tensor in local.weights().items():
            torch.testing.assert_close(remote_weights[name], tensor, atol=1e-5, rtol=0)
        remote.save(run_dir=tmp_path / "remote", step=2, data_position={"version": 2}, run_config={}, metrics={},
                    keep_last=2)
        remote.shutdown()
    finally:
        ray.shutdown()
    resumed = Learner(rl_config(tmp_path / "remote"))
    assert resumed.restore(tmp_path / "remote") == {"version": 2}
    for name, tensor in resumed.weights().items():
        torch.testing.assert_close(tensor, remote_weights[name], atol=0, rtol=0)
    after_local, after_resumed = local.update(records), resumed.update(records)
    assert after_resumed.stats["loss"] == pytest.approx(after_local.stats["loss"], abs=1e-6)


@pytest.mark.django_db
@pytest.mark.parametrize("raw", ['"learner_gpus": NaN', '"learner_gpus": 1e400', '"inference_gpus": -0.5',
                                 '"inference_gpus": 2.5', '"learner_gpus": "all"', '"learner_gpus": true'])
def test_the_experiments_api_refuses_hostile_gpu_counts_before_anything_is_stored(api_client_for, owner,
                                                                                policy_checkpoint, raw):
    import json

    from webapp.experiments.models import Experiment

    config = json.dumps({"init_checkpoint": policy_checkpoint, "steps": 1})[:-1] + ", " + raw + "}"
    body = '{"name": "gpus", "config": ' + config + "}"
    answer = api_client_for(owner).post("/api/experiments/", body, content_type="application/json")
    assert answer.status_code == 400, answer.content
    # Non-finite numbers stop at the JSON parser; the others are named by the config's own check.
    field = raw.split('"')[1]
    expected = "JSON numbers are finite" if "NaN" in raw else "too large" if "1e400" in raw else field
    assert expected in answer.content.decode()
    assert not Experiment.objects.exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a lent GPU machine)")
def test_on_a_gpu_the_learner_and_an_inference_actor_run_on_it_and_agree_with_the_cpu(policy_checkpoint, tmp_path):
    """On a machine with CUDA: the learner actor (1 GPU) and an inference actor (half of the other or the same
    GPU) put the policy on CUDA with bf16 experts, and the learner's update is close to the CPU learner's."""
    from training.rollout.actors import InferenceServer
    from training.rollout.learner_actor import RemoteLearner

    config = RLConfig(run_dir=str(tmp_path / "gpu"), init_checkpoint=policy_checkpoint, temperature=1.0,
                      routing_replay=True, optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0, weight_decay=0.0))
    records = _records(policy_checkpoint)
    cpu = Learner(dataclasses.replace(config, run_dir=str(tmp_path / "cpu")))
    cpu.restore(tmp_path / "cpu")
    expected = cpu.update(records)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        learner = RemoteLearner(config, gpus=0.5)
        assert learner.description["device"].startswith("cuda") and learner.description["precision"] == "bf16"
        learner.restore(tmp_path / "gpu")
        got = learner.update(records)
        assert got.stats["trained_tokens"] == expected.stats["trained_tokens"]
        assert got.stats["loss"] == pytest.approx(expected.stats["loss"], rel=0.05, abs=1e-3)  # bf16 experts
        server = ray.remote(InferenceServer).options(num_gpus=0.5).remote(
            policy_checkpoint, str(tmp_path / "gpu"), 2, True, None, 0.5)
        completion = ray.get(server.complete.remote(
            messages=[{"role": "user", "content": "fix the bug"}], tools=None, max_tokens=8, temperature=1.0,
            top_p=1.0, timeout_s=60.0, seed=0))
        assert 0 < completion.completion_tokens <= 8 and all(math.isfinite(x) for x in completion.logprobs)
        learner.shutdown()
    finally:
        ray.shutdown()
