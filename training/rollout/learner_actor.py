"""The learner as a Ray actor on its own GPU(s), driven through the same few calls as the in-process one.

With AsyncRLConfig.learner_gpus > 0 the driver (the single controller) does not load the policy itself:
``RemoteLearner`` places a ``LearnerActor`` with that many GPUs and forwards the calls the driver makes,
restore, update, weights, save and expert_record, each one round trip. The actor holds a
training.train.learner.Learner on its device (training.devices.actor_device); records go in and CPU
weights come out through Ray's object store. The lr schedule's clock (the share of a time budget spent)
is the driver's: it is sent with every update.

A learner actor that dies is not restarted (its optimizer state would be lost between checkpoints): the
call fails, the run stops with that error, and a new start resumes from the last checkpoint as after a
killed driver. Checkpoints are written by the actor into run_dir, which must therefore be the same path on
the actor's node (a shared filesystem on a cluster, as for the inference actors that read it).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training.train.learner import UpdateResult
    from training.train.rl import RLConfig
    from training.train.rollouts import RolloutRecord


class LearnerActor:
    """Body of the learner actor: a Learner on the device Ray gave it, and the driver's budget clock."""

    def __init__(self, config: RLConfig, gpus: float) -> None:
        from training.devices import actor_device
        from training.train.learner import Learner

        self._time_fraction = 0.0
        self.learner = Learner(
            config, time_fraction=lambda: self._time_fraction, device=actor_device(gpus=gpus, role="learner")
        )

    def describe(self) -> dict[str, Any]:
        """Where it runs: device, expert precision, whether the policy has its own (HF) tokenizer, pid."""
        import os

        return {"device": str(self.learner.device), "precision": self.learner.precision,
                "uses_hf_tokenizer": self.learner.uses_hf_tokenizer, "pid": os.getpid()}

    def restore(self, run_dir: str) -> dict[str, Any] | None:
        return self.learner.restore(run_dir)

    def update(self, records: list[RolloutRecord], time_fraction: float | None) -> UpdateResult:
        if time_fraction is not None:
            self._time_fraction = time_fraction
        return self.learner.update(records)

    def weights(self) -> dict:
        return self.learner.weights()

    def save(self, kwargs: dict[str, Any]) -> float:
        return self.learner.save(**kwargs)

    def expert_record(self, kwargs: dict[str, Any]) -> RolloutRecord:
        return self.learner.expert_record(**kwargs)


class RemoteLearner:
    """The driver's handle on a LearnerActor, with the in-process Learner's interface (the calls AsyncRun makes).

    gpus: what the actor asks Ray for (0 places it on the CPU, which tests use to compare it with the
    in-process learner); time_fraction: the driver's clock, sent with every update.
    """

    def __init__(self, config: RLConfig, *, gpus: float, time_fraction=None) -> None:
        import ray

        self.config = config
        self._time_fraction = time_fraction
        actor_cls = ray.remote(LearnerActor).options(num_cpus=0, num_gpus=gpus, max_restarts=0, max_concurrency=1)
        self.actor = actor_cls.remote(config, gpus)
        # The first call surfaces a constructor failure (no CUDA where Ray gave GPUs, a bad checkpoint) here.
        self.description = ray.get(self.actor.describe.remote())
        self.uses_hf_tokenizer = bool(self.description["uses_hf_tokenizer"])

    def restore(self, run_dir: str | Path) -> dict[str, Any] | None:
        import ray

        return ray.get(self.actor.restore.remote(str(run_dir)))

    def update(self, records: list[RolloutRecord]) -> UpdateResult:
        import ray

        fraction = None if self._time_fraction is None else float(self._time_fraction())
        return ray.get(self.actor.update.remote(records, fraction))

    def weights(self) -> dict:
        import ray

        return ray.get(self.actor.weights.remote())

    def save(self, **kwargs: Any) -> float:
        import ray

        return ray.get(self.actor.save.remote(kwargs))

    def expert_record(self, **kwargs: Any) -> RolloutRecord:
        import ray

        return ray.get(self.actor.expert_record.remote(kwargs))

    def shutdown(self) -> None:
        import ray

        ray.kill(self.actor)
