"""Asynchronous GRPO with a Ray single controller: this process owns the control flow.

    .venv/bin/python -m training.rollout.driver --config run.json      (a JSON AsyncRLConfig)

The run's pieces live in their own modules: its typed config (training.rollout.config), the
run-directory file protocol the web app reads (training.rollout.run_dir) and the Ray actors
(training.rollout.actors: inference servers with versioned weights, rollout workers that run the
agent loop in a sandbox and score it, driven through ``ActorPool``). Their public names are importable from
here too. ``AsyncRun`` is the single controller: it owns the learner (training.train.learner.Learner, the
same one the synchronous training.train.rl.rl drives in-process), the actor pool and the scheduler.

The driver feeds the continuous `RolloutScheduler` (bounded staleness, a slow rollout never holds
the others back), trains in a learner thread (``AsyncRun.train``: Learner.update) while generation continues, and checkpoints after every update.
The checkpoint records which groups were trained on; a restarted driver (killed driver, lost
worker, redelivered Celery task) resumes from it, re-runs only groups that were never trained on,
and truncates the logs to the checkpoint, so no rollout is counted twice.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.rollout.actors import (
    ActorPool,
    ExpertResult,
    InferenceCompletion,
    InferenceServer,
    RemoteInferencePolicy,
    RolloutResult,
    RolloutServer,
    _edit_file_arguments,
    task_for_group,
)
from training.rollout.config import (
    AsyncRLConfig,
    AsyncRLConfigError,
    config_argument_parser,
    update_config_for,
)
from training.rollout.run_dir import (
    METRICS_FILE,
    ROLLOUTS_FILE,
    STATUS_FILE,
    TRACES_DIR,
    RolloutRow,
    append_jsonl,
    checkpointed_version,
    read_jsonl,
    read_status,
    run_finished,
    trace_path,
    truncate_jsonl,
    write_json,
    write_status,
)
from training.rollout.scheduler import RolloutRequest, RolloutSample, RolloutScheduler

__all__ = [
    "METRICS_FILE",
    "ROLLOUTS_FILE",
    "STATUS_FILE",
    "TRACES_DIR",
    "ActorPool",
    "AsyncRLConfig",
    "AsyncRLConfigError",
    "AsyncRun",
    "ExpertResult",
    "InferenceCompletion",
    "InferenceServer",
    "RemoteInferencePolicy",
    "RolloutResult",
    "RolloutServer",
    "_edit_file_arguments",
    "checkpointed_version",
    "main",
    "read_jsonl",
    "read_status",
    "run_async_rl",
    "run_finished",
    "task_for_group",
    "trace_path",
    "update_config_for",
]

logger = logging.getLogger(__name__)


@dataclass
class _RunState:
    version: int = 0
    counted_groups: set[str] = field(default_factory=set)
    started_at: float = field(default_factory=time.monotonic)
    earlier_training_seconds: float = 0.0
    """Training time of the run's earlier starts (restored from the checkpoint), for the time budget."""
    generated_samples: int = 0
    abandoned_lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned_groups: list = field(default_factory=list)
    """Groups the scheduler abandoned after their probe, logged with the next update."""


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run_async_rl(
    config: AsyncRLConfig,
    *,
    on_step: Callable[[dict], None] | None = None,
    on_rollout: Callable[[dict], None] | None = None,
    stop: threading.Event | None = None,
) -> list[dict]:
    """Run (or resume) the experiment until `config.steps` updates exist; returns this call's metrics."""
    return AsyncRun(config, on_step=on_step, on_rollout=on_rollout).run(stop=stop or threading.Event())


class AsyncRun:
    """The single controller of an asynchronous run: the learner in this process, the actors on Ray.

    ``run`` starts the actors, feeds the scheduler and waits; the scheduler calls ``submit_rollout`` for every
    rollout and ``train`` (in a learner thread) for every batch of complete groups.
    """

    def __init__(
        self,
        config: AsyncRLConfig,
        *,
        on_step: Callable[[dict], None] | None = None,
        on_rollout: Callable[[dict], None] | None = None,
    ) -> None:
        self.config = config
        self.on_step, self.on_rollout = on_step, on_rollout
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.state = _RunState()
        self.budget_seconds = None if config.time_budget_minutes is None else config.time_budget_minutes * 60
        self.clock_started = False
        # With learner_gpus the learner is a Ray actor on its GPU(s) (training.rollout.learner_actor), so Ray
        # starts here; on the CPU it lives in this process.
        self._ray = _ray_start(config) if config.learner_gpus > 0 else None
        try:
            self.learner = _learner_create(
                config,
                time_fraction=None if self.budget_seconds is None else lambda: self.training_seconds() / self.budget_seconds,
            )
        except BaseException:
            _ray_stop(self._ray)
            raise
        if config.expert_guidance and self.learner.uses_hf_tokenizer:
            # The scripted expert's trajectories are scored through the built-in chat format and tokenizer.
            self._release_learner(self._ray)
            raise AsyncRLConfigError(
                "expert_guidance works with the built-in model's tokenizer only; turn it off for an imported model"
            )
        # The budget's clock starts once the policy is loaded (loading it is not training): the first
        # update's lr is the schedule's value at 0, as the schedule was built before the clock ran.
        self.state.started_at, self.clock_started = time.monotonic(), True
        restored = self.learner.restore(self.run_dir)
        if restored is not None:
            self.state.version = int(restored["version"])
            self.state.counted_groups = set(restored["counted_groups"])
            self.state.earlier_training_seconds = float(restored.get("training_seconds", 0.0))
        for name in (METRICS_FILE, ROLLOUTS_FILE):
            truncate_jsonl(self.run_dir / name, max_step=self.state.version)
        self.actors: ActorPool | None = None
        self.scheduler: RolloutScheduler | None = None
        self.history: list[dict] = []

    def training_seconds(self) -> float:
        running = time.monotonic() - self.state.started_at if self.clock_started else 0.0
        return self.state.earlier_training_seconds + running

    def budget_spent(self) -> bool:
        return self.budget_seconds is not None and self.training_seconds() >= self.budget_seconds

    def run(self, *, stop: threading.Event) -> list[dict]:
        """Dispatch and train until `steps` updates exist, the budget is spent or `stop` is set."""
        if self.state.version >= self.config.steps or self.budget_spent():
            # Started again after the end (a resume, a relaunch): say so, so the monitor stops relaunching it.
            write_status(self.run_dir, {"state": "finished", "pid": os.getpid(), "version": self.state.version})
            self._release_learner(self._ray)
            return []
        started = self._ray or _ray_start(self.config)
        try:
            self.actors = ActorPool(self.config, run_dir=self.run_dir, fleet=started[2])
            self._dispatch(stop)
        finally:
            if self.actors is not None:
                self.actors.shutdown()
            self._release_learner(started)
        # A stop can come while an update is in flight: the scheduler no longer waits for it, the learner's
        # shutdown above does, and that update is checkpointed, so the run's version is the learner's.
        version = max(self.scheduler.version if self.scheduler else 0, self.state.version)
        finished = version >= self.config.steps or self.budget_spent()
        write_status(
            self.run_dir, {"state": "finished" if finished else "stopped", "pid": os.getpid(), "version": version}
        )
        return self.history

    def _dispatch(self, stop: threading.Event) -> None:
        """Feed the scheduler (rollouts on the actors, updates in a learner thread) until it stops."""
        assert self.actors is not None
        if self.state.version > 0:
            self.actors.push_weights(self.state.version, self.learner.weights())
        # The budget's stop works like a pause: dispatching ends, the update in progress is checkpointed.
        budget_timer = None
        if self.budget_seconds is not None:
            budget_timer = threading.Timer(max(0.0, self.budget_seconds - self.training_seconds()), stop.set)
            budget_timer.daemon = True
        learner_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")
        self.scheduler = RolloutScheduler(
            config=self.config.scheduler_config,
            submit_rollout=self.submit_rollout,
            submit_update=lambda groups, version: learner_thread.submit(self.train, groups, version),
            groups=_group_stream(),
            start_version=self.state.version,
            is_counted=lambda group_id: group_id in self.state.counted_groups,
            reward_of=lambda result: result.record.reward,
            on_group_abandoned=self._abandon_group,
            stop=stop,
        )
        try:
            write_status(
                self.run_dir,
                {"state": "running", "pid": os.getpid(), "version": self.state.version, **self.actors.pids()},
            )
            if budget_timer is not None:
                budget_timer.start()
            self.scheduler.run(steps=self.config.steps - self.state.version)
        finally:
            if budget_timer is not None:
                budget_timer.cancel()
            learner_thread.shutdown(wait=True)

    def _release_learner(self, started) -> None:
        """Stop a learner actor (an in-process learner needs nothing) and the Ray this run started, if any."""
        if hasattr(self.learner, "shutdown"):
            self.learner.shutdown()
        _ray_stop(started)

    def submit_rollout(self, request: RolloutRequest, version: int) -> Future:
        return self.actors.submit(
            group_index=int(request.task_key),
            sample_index=request.sample_index,
            rollout_id=request.rollout_id,
            version=version,
        )

    def _abandon_group(self, group: list[RolloutSample]) -> None:
        with self.state.abandoned_lock:
            self.state.abandoned_groups.append(group)

    def train(self, groups: list[list[RolloutSample]], version: int) -> int:
        """One policy update on complete groups (plus the log of groups abandoned since the last one);
        logs, checkpoints and pushes the new weights; returns the new policy version."""
        update_started = time.monotonic()
        with self.state.abandoned_lock:
            abandoned, self.state.abandoned_groups = self.state.abandoned_groups, []
        records = []
        for group_position, group in enumerate(groups):
            for sample in group:
                sample.result.record.group = group_position
                records.append(sample.result.record)
        guides, guide_failures = self._expert_guides(groups) if self.config.expert_guidance else ([], [])
        # Expert members come after the rollouts, so advantages[i] is still records[i]'s for the logs below.
        update = self.learner.update([*records, *guides])
        new_version = version + 1
        self.state.counted_groups.update(group[0].request.group_id for group in [*groups, *abandoned])
        metrics = self._metrics(new_version, groups=groups, abandoned=abandoned, update=update)
        metrics.update(
            guided_groups=len(guides), guide_failures=len(guide_failures), training_seconds=self.training_seconds()
        )
        # The update's stage covers what the learner thread did for it: expert guides, advantages, the steps.
        metrics["stage_seconds"]["update"] = time.monotonic() - update_started
        rows = _rollout_rows(
            new_version, groups=groups, abandoned=abandoned, advantages=update.advantages,
            guided_positions={guide.group for guide in guides},
        )
        samples = [sample for group in [*groups, *abandoned] for sample in group]
        # Logs first, checkpoint second: a crash in between leaves log lines past the checkpoint,
        # which the resumed run truncates and then redoes, so no step or rollout is logged twice.
        (self.run_dir / TRACES_DIR).mkdir(exist_ok=True)
        for sample, row in zip(samples, rows, strict=True):
            write_json(trace_path(self.run_dir, row.rollout_id), sample.result.trace)
        for row in rows:
            append_jsonl(self.run_dir / ROLLOUTS_FILE, row.as_dict())
        append_jsonl(self.run_dir / METRICS_FILE, metrics)
        checkpoint_seconds = self.learner.save(
            run_dir=self.run_dir,
            step=new_version,
            data_position={
                "version": new_version,
                "counted_groups": sorted(self.state.counted_groups),
                "training_seconds": self.training_seconds(),
            },
            run_config={"stage": "async-rl", **dataclasses.asdict(self.config)},
            metrics=metrics,
            keep_last=self.config.keep_checkpoints,
        )
        weight_push_seconds = self.actors.push_weights(new_version, self.learner.weights())
        metrics["stage_seconds"].update(checkpoint=checkpoint_seconds, weight_push=weight_push_seconds)
        self.history.append(metrics)
        if self.on_rollout is not None:
            for sample, row in zip(samples, rows, strict=True):
                self.on_rollout({**row.as_dict(), "trace": sample.result.trace})
        if self.on_step is not None:
            self.on_step(metrics)
        self.state.version = new_version
        return new_version

    def _metrics(
        self, new_version: int, *, groups: list[list[RolloutSample]], abandoned: list[list[RolloutSample]], update
    ) -> dict[str, Any]:
        """The update's metrics: the learner's vocabulary (training.train.learner) plus the fleet's figures."""
        from training.train.learner import rollout_metrics, update_metrics

        samples = [sample for group in groups for sample in group]
        abandoned_samples = [sample for group in abandoned for sample in group]
        results: list[RolloutResult] = [sample.result for sample in samples]
        tool_turns = sum(result.stats["tool_turns"] for result in results)
        wall = time.monotonic() - self.state.started_at
        self.state.generated_samples += len(samples) + len(abandoned_samples)
        # The first probe_size rollouts of every group, trained or abandoned: a sample of the policy on
        # fresh tasks that probing does not tilt (finished groups are the ones whose probe disagreed).
        probe_size = self.config.probe_size or self.config.group_size
        sampled = [
            sample.result.record
            for sample in [*samples, *abandoned_samples]
            if sample.request.sample_index < probe_size and sample.result.record.valid
        ]
        stats = self.scheduler.stats
        return {
            "step": new_version,
            **rollout_metrics([result.record for result in results]),
            "tool_calls_per_turn": sum(result.stats["tool_calls"] for result in results) / tool_turns if tool_turns else 0.0,
            "parallel_call_share": (
                sum(result.stats["parallel_turns"] for result in results) / tool_turns if tool_turns else 0.0
            ),
            "staleness_mean": _mean([float(sample.staleness) for sample in samples]),
            "staleness_max": max(sample.staleness for sample in samples),
            # Every finished rollout, abandoned probes included: what the fleet produced.
            "rollouts_per_s": self.state.generated_samples / wall if wall > 0 else 0.0,
            "abandoned_groups": len(abandoned),
            "abandoned_rollouts": len(abandoned_samples),
            # pass_rate covers the trained groups only, which probing tilts towards tasks that are neither
            # always solved nor never; this one is the policy's pass rate on the tasks it was given.
            "sampled_pass_rate": _mean([float(record.passed) for record in sampled]),
            "worker_utilization": min(1.0, stats.busy_seconds / (self.config.rollout_workers * wall)),
            "dropped_stale_total": stats.dropped_stale,
            "failed_rollouts_total": stats.failed,
            **update_metrics(update),
            "stage_seconds": {
                "sandbox": _mean([result.timings["sandbox_s"] for result in results]),
                "agent": _mean([result.timings["agent_s"] for result in results]),
                "reward": _mean([result.timings["reward_s"] for result in results]),
                "update": update.seconds,
            },
        }

    def _expert_guides(self, groups: list[list[RolloutSample]]) -> tuple[list, list[str]]:
        """Expert members for the groups none of whose valid rollouts passed, and why any could not be made.

        The expert runs on a rollout worker (an environment server, in the rollouts' kind of sandbox) that
        it borrows from the actor pool; the learner scores its tokens with the weights this update starts from.
        """

        guides, failures = [], []
        for group_position, group in enumerate(groups):
            valid = [sample.result.record for sample in group if sample.result.record.valid]
            if not valid or any(record.passed for record in valid):
                continue
            result = self.actors.expert(group_index=int(group[0].request.task_key))
            if result.error is not None:
                logger.warning("no expert guidance for %s: %s", group[0].request.group_id, result.error)
                failures.append(result.error)
                continue
            guides.append(
                self.learner.expert_record(
                    task_id=result.task_id, group=group_position, messages=result.messages, reward=result.reward
                )
            )
        return guides, failures


def _group_stream():
    index = 0
    while True:
        yield f"group-{index:06d}", str(index)
        index += 1


def _rollout_rows(
    new_version: int,
    *,
    groups: list[list[RolloutSample]],
    abandoned: list[list[RolloutSample]],
    advantages: list[float],
    guided_positions: set[int],
) -> list[RolloutRow]:
    """The rollouts.jsonl rows of one update: trained groups in order (advantages follow them), then abandoned."""
    rows = []
    labelled = [(group, False) for group in groups] + [(group, True) for group in abandoned]
    for group_position, (group, was_abandoned) in enumerate(labelled):
        for sample in group:
            record = sample.result.record
            rows.append(
                RolloutRow(
                    step=new_version,
                    abandoned=was_abandoned,
                    rollout_id=sample.request.rollout_id,
                    group_id=sample.request.group_id,
                    task_id=record.task_id,
                    sample_index=sample.request.sample_index,
                    valid=record.valid,
                    reward=record.reward,
                    passed=record.passed,
                    tests_total=record.tests_total,
                    status=record.status,
                    # records follow the groups in this order: the row's position is its record's.
                    advantage=0.0 if was_abandoned else float(advantages[len(rows)]),
                    completion_tokens=record.completion_tokens,
                    turns=record.turns,
                    policy_version=sample.policy_version,
                    staleness=sample.staleness,
                    tools_used=sample.result.stats["tools_used"],
                    tool_calls=sample.result.stats["tool_calls"],
                    group_position=group_position,
                    guided=group_position in guided_positions,
                )
            )
    return rows


def _ray_start(config: AsyncRLConfig):
    """(ray, owns_ray, fleet, fleet_started): join or start Ray, and attach to (or start) the sandbox hosts."""
    import ray

    owns_ray = not ray.is_initialized()
    if owns_ray:
        if config.ray_address:
            ray.init(address=config.ray_address, ignore_reinit_error=True, log_to_driver=False)
        else:
            # address="local": a new Ray of its own; with no address Ray would join the newest cluster
            # `ray start` left on this machine (another checkout's `make run`, say) and refuse num_cpus.
            ray.init(
                address="local",
                num_cpus=config.ray_num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
                resources={"sandbox_slots": config.rollout_workers} if config.sandbox_hosts else None,
            )
    needed = config.learner_gpus + config.inference_actors * config.inference_gpus
    if needed > 0:
        from training.devices import cluster_gpus_check

        try:
            cluster_gpus_check(
                needed=needed, available=float(ray.cluster_resources().get("GPU", 0)),
                detail=f"learner {config.learner_gpus:g} + {config.inference_actors} inference actors x "
                f"{config.inference_gpus:g}",
            )
        except Exception:
            _ray_stop((ray, owns_ray, None, False))
            raise
    fleet, fleet_started = _fleet_start(config) if config.sandbox_hosts else (None, False)
    return ray, owns_ray, fleet, fleet_started


def _ray_stop(started) -> None:
    """Undo _ray_start's answer (None: nothing was started): the fleet it started, the Ray it owns."""
    if started is None:
        return
    ray, owns_ray, fleet, fleet_started = started
    if fleet is not None and fleet_started:
        fleet.shutdown()
    if owns_ray:
        ray.shutdown()


def _learner_create(config: AsyncRLConfig, *, time_fraction: Callable[[], float] | None):
    """The run's learner: in this process on the CPU, or a Ray actor on learner_gpus GPUs (same interface)."""
    if config.learner_gpus > 0:
        from training.rollout.learner_actor import RemoteLearner

        return RemoteLearner(update_config_for(config), gpus=config.learner_gpus, time_fraction=time_fraction)
    from training.train.learner import Learner

    return Learner(update_config_for(config), time_fraction=time_fraction)


def _fleet_start(config: AsyncRLConfig):
    """(fleet, started_here): attach to running sandbox-host actors, or start one per node with slots."""
    from sandboxes.base import SandboxError
    from sandboxes.fleet.client import Fleet, FleetConfig

    fleet_config = FleetConfig(backend=config.sandbox_backend or "local")
    if not config.fleet_heartbeats:
        fleet_config = dataclasses.replace(fleet_config, heartbeat_sink=None)
    try:
        return Fleet.connect(fleet_config), False
    except SandboxError:
        return Fleet.start(fleet_config), True


def main(argv: list[str] | None = None) -> None:
    parser = config_argument_parser(AsyncRLConfig, description="Asynchronous GRPO driver (Ray single controller).")
    parser.add_argument(
        "--config", help="JSON file with AsyncRLConfig fields; the flags below override its values"
    )
    args = vars(parser.parse_args(argv))
    path = args.pop("config", None)
    data = json.loads(Path(path).read_text()) if path else {}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = AsyncRLConfig.from_dict({**data, **args})
    except (AsyncRLConfigError, TypeError) as error:
        parser.error(str(error))
    stop = threading.Event()
    # SIGTERM (pause, cancel, shutdown) stops dispatching; the update in progress still finishes and
    # is checkpointed, so a later start resumes exactly there.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for metrics in run_async_rl(config, stop=stop):
        logger.info("step %s: reward %s", metrics["step"], metrics["mean_reward"])


if __name__ == "__main__":
    main()
