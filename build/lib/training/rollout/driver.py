"""Asynchronous GRPO with a Ray single controller: this process owns the control flow.

    .venv/bin/python -m training.rollout.driver --config run.json      (a JSON AsyncRLConfig)

The run's pieces live in their own modules: its typed config (training.rollout.config), the
run-directory file protocol the web app reads (training.rollout.run_dir) and the Ray actors
(training.rollout.actors: inference servers with versioned weights, rollout workers that run the
agent loop in a sandbox and score it). Their public names are importable from here too.

The driver feeds the continuous `RolloutScheduler` (bounded staleness, a slow rollout never holds
the others back), trains in a learner thread with the trainer's GRPO update
(training.train.rl.policy_updates) while generation continues, and checkpoints after every update.
The checkpoint records which groups were trained on; a restarted driver (killed driver, lost
worker, redelivered Celery task) resumes from it, re-runs only groups that were never trained on,
and truncates the logs to the checkpoint, so no rollout is counted twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from training.rollout.actors import (
    InferenceServer,
    RemoteInferencePolicy,
    RolloutServer,
    _edit_file_arguments,
    task_for_group,
)
from training.rollout.config import AsyncRLConfig, AsyncRLConfigError, update_config_for
from training.rollout.run_dir import (
    METRICS_FILE,
    ROLLOUTS_FILE,
    STATUS_FILE,
    TRACES_DIR,
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
    "AsyncRLConfig",
    "AsyncRLConfigError",
    "InferenceServer",
    "RemoteInferencePolicy",
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
    import ray
    import torch

    from training.checkpoint import load_checkpoint
    from training.train.guidance import expert_record_create
    from training.train.loop import build_optimizer, build_scheduler
    from training.train.rl import (
        policy_updates,
        reference_model_load,
        rollout_advantages,
        segments_to_batches,
    )
    from training.train.state import latest_checkpoint, load_train_checkpoint, save_train_checkpoint

    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer, _ = load_checkpoint(config.init_checkpoint)
    model.train()
    update_config = update_config_for(config)
    optimizer = build_optimizer(model, update_config.optimizer)
    state = _RunState()

    def training_seconds() -> float:
        return state.earlier_training_seconds + time.monotonic() - state.started_at

    budget_seconds = None if config.time_budget_minutes is None else config.time_budget_minutes * 60
    lr_schedule = build_scheduler(
        optimizer,
        update_config.optimizer,
        total_steps=config.steps,
        time_fraction=None if budget_seconds is None else lambda: training_seconds() / budget_seconds,
    )
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None:
        restored = load_train_checkpoint(
            path=checkpoint, model=model, optimizer=optimizer, scheduler=lr_schedule
        )
        state.version = int(restored.data_position["version"])
        state.counted_groups = set(restored.data_position["counted_groups"])
        state.earlier_training_seconds = float(restored.data_position.get("training_seconds", 0.0))
    else:
        torch.manual_seed(config.seed)
    for name in (METRICS_FILE, ROLLOUTS_FILE):
        truncate_jsonl(run_dir / name, max_step=state.version)

    def budget_spent() -> bool:
        return budget_seconds is not None and training_seconds() >= budget_seconds

    if state.version >= config.steps or budget_spent():
        # Started again after the end (a resume, a relaunch): say so, so the monitor stops relaunching it.
        write_status(run_dir, {"state": "finished", "pid": os.getpid(), "version": state.version})
        return []
    reference_model = reference_model_load(update_config)

    owns_ray = not ray.is_initialized()
    if owns_ray:
        if config.ray_address:
            ray.init(address=config.ray_address, ignore_reinit_error=True, log_to_driver=False)
        else:
            ray.init(
                num_cpus=config.ray_num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
                resources={"sandbox_slots": config.rollout_workers} if config.sandbox_hosts else None,
            )
    fleet, fleet_started = _fleet_start(config) if config.sandbox_hosts else (None, False)
    # A dead actor process is restarted by Ray; the call it was running fails, and the scheduler
    # re-dispatches that slot under a new rollout id instead of scoring it.
    # SPREAD: on a cluster of several nodes the actors go round the nodes (one node's loss takes a
    # share of them, which Ray restarts on the others), not all onto the driver's node.
    inference_cls = ray.remote(InferenceServer).options(
        num_cpus=0, max_concurrency=config.rollout_workers + 2, max_restarts=-1, max_task_retries=0,
        scheduling_strategy="SPREAD",
    )
    worker_cls = ray.remote(RolloutServer).options(
        num_cpus=0, max_concurrency=1, max_restarts=-1, max_task_retries=0, scheduling_strategy="SPREAD"
    )
    config_data = asdict(config)
    inference_actors = [
        inference_cls.remote(config.init_checkpoint, str(run_dir), config.rollout_workers, config.copy_constraint)
        for _ in range(config.inference_actors)
    ]
    workers = [worker_cls.remote(config_data) for _ in range(config.rollout_workers)]
    idle_workers: queue.Queue = queue.Queue()
    for index, worker in enumerate(workers):
        idle_workers.put((worker, inference_actors[index % len(inference_actors)]))

    def push_weights(version: int) -> float:
        started = time.monotonic()
        weights = ray.put({name: tensor.detach().clone() for name, tensor in model.state_dict().items()})
        ray.get([actor.set_weights.remote(version, weights) for actor in inference_actors])
        return time.monotonic() - started

    if state.version > 0:
        push_weights(state.version)

    def group_stream():
        index = 0
        while True:
            yield f"group-{index:06d}", str(index)
            index += 1

    def submit_rollout(request: RolloutRequest, version: int) -> Future:
        worker, inference = idle_workers.get()
        seed = (
            config.seed * 1_000_003 + int(request.task_key) * 7919 + request.sample_index * 104_729 + version
        )
        future = worker.run.remote(
            group_index=int(request.task_key),
            sample_index=request.sample_index,
            rollout_id=request.rollout_id,
            inference=inference,
            seed=seed,
            fleet=fleet,
        ).future()
        future.add_done_callback(lambda _done: idle_workers.put((worker, inference)))
        return future

    history: list[dict] = []

    def train(groups: list[list[RolloutSample]], version: int) -> int:
        update_started = time.monotonic()
        samples = [sample for group in groups for sample in group]
        with state.abandoned_lock:
            abandoned, state.abandoned_groups = state.abandoned_groups, []
        abandoned_samples = [sample for group in abandoned for sample in group]
        records = []
        for group_position, group in enumerate(groups):
            for sample in group:
                sample.result["record"].group = group_position
                records.append(sample.result["record"])
        guides, guide_failures = expert_guides(groups) if config.expert_guidance else ([], [])
        # Expert members come after the rollouts, so advantages[i] is still records[i]'s for the logs below.
        advantages = rollout_advantages([*records, *guides], update_config.grpo)
        batches = segments_to_batches(
            records=[*records, *guides],
            advantages=advantages,
            micro_batch_size=1,
            pad_id=tokenizer.pad_id,
            with_routing=model.config.is_moe,
            merge_turns=update_config.grpo.normalization == "token",
        )
        lr_used = lr_schedule.get_last_lr()[0]
        update_stats = policy_updates(
            model=model, optimizer=optimizer, batches=batches, config=update_config, reference_model=reference_model
        )
        # The schedule follows the policy version even when this update trained nothing (a group that
        # all passed or all failed has no advantage): `steps` counts versions, and a schedule that
        # waited for trained updates would still be short of its decay when the run ends (40 % of a
        # run's updates can train nothing). If the first update trained nothing, torch warns once that
        # a schedule value was skipped; none was.
        lr_schedule.step()
        update_seconds = time.monotonic() - update_started
        new_version = version + 1
        state.counted_groups.update(group[0].request.group_id for group in [*groups, *abandoned])

        valid = [record for record in records if record.valid]
        results = [sample.result for sample in samples]
        tool_calls = sum(result["stats"]["tool_calls"] for result in results)
        tool_turns = sum(result["stats"]["tool_turns"] for result in results)
        wall = time.monotonic() - state.started_at
        state.generated_samples += len(samples) + len(abandoned_samples)
        # The first probe_size rollouts of every group, trained or abandoned: a sample of the policy on
        # fresh tasks that probing does not tilt (finished groups are the ones whose probe disagreed).
        probe_size = config.probe_size or config.group_size
        sampled = [
            sample.result["record"]
            for sample in [*samples, *abandoned_samples]
            if sample.request.sample_index < probe_size and sample.result["record"].valid
        ]
        metrics = {
            "step": new_version,
            "rollouts": len(samples),
            "valid_rollouts": len(valid),
            "masked_rollouts": len(records) - len(valid),
            "mean_reward": _mean([record.reward for record in valid]),
            "pass_rate": _mean([float(record.passed) for record in valid]),
            "mean_completion_tokens": _mean([float(record.completion_tokens) for record in records]),
            "mean_turns": _mean([float(record.turns) for record in records]),
            "tool_calls_per_turn": tool_calls / tool_turns if tool_turns else 0.0,
            "parallel_call_share": (
                sum(result["stats"]["parallel_turns"] for result in results) / tool_turns
                if tool_turns
                else 0.0
            ),
            "staleness_mean": _mean([float(sample.staleness) for sample in samples]),
            "staleness_max": max(sample.staleness for sample in samples),
            # Every finished rollout, abandoned probes included: what the fleet produced.
            "rollouts_per_s": state.generated_samples / wall if wall > 0 else 0.0,
            "abandoned_groups": len(abandoned),
            "guided_groups": len(guides),
            "guide_failures": len(guide_failures),
            "abandoned_rollouts": len(abandoned_samples),
            # pass_rate covers the trained groups only, which probing tilts towards tasks that are neither
            # always solved nor never; this one is the policy's pass rate on the tasks it was given.
            "sampled_pass_rate": _mean([float(record.passed) for record in sampled]),
            "worker_utilization": min(1.0, scheduler.stats.busy_seconds / (config.rollout_workers * wall)),
            "dropped_stale_total": scheduler.stats.dropped_stale,
            "lr": lr_used,
            "failed_rollouts_total": scheduler.stats.failed,
            "stage_seconds": {
                "sandbox": _mean([result["timings"]["sandbox_s"] for result in results]),
                "agent": _mean([result["timings"]["agent_s"] for result in results]),
                "reward": _mean([result["timings"]["reward_s"] for result in results]),
                "update": update_seconds,
            },
            **{
                key: value
                for key, value in update_stats.items()
                if key
                in ("loss", "clip_fraction", "approx_kl", "entropy", "kl_to_reference", "trained_tokens",
                    "shared_prefix_tokens")
            },
        }
        rollout_rows = []
        guided_positions = {guide.group for guide in guides}
        labelled = [(group, False) for group in groups] + [(group, True) for group in abandoned]
        for group_position, (group, was_abandoned) in enumerate(labelled):
            for sample in group:
                record = sample.result["record"]
                rollout_rows.append(
                    {
                        "step": new_version,
                        "abandoned": was_abandoned,
                        "rollout_id": sample.request.rollout_id,
                        "group_id": sample.request.group_id,
                        "task_id": record.task_id,
                        "sample_index": sample.request.sample_index,
                        "valid": record.valid,
                        "reward": record.reward,
                        "passed": record.passed,
                        "status": record.status,
                        # records follow the groups in this order; list.index would compare records
                        # field by field and fail on their tensors once two agree up to those.
                        "advantage": 0.0 if was_abandoned else float(advantages[len(rollout_rows)]),
                        "completion_tokens": record.completion_tokens,
                        "turns": record.turns,
                        "policy_version": sample.policy_version,
                        "staleness": sample.staleness,
                        "tools_used": sample.result["stats"]["tools_used"],
                        "tool_calls": sample.result["stats"]["tool_calls"],
                        "group_position": group_position,
                        "guided": group_position in guided_positions,
                    }
                )
        # Logs first, checkpoint second: a crash in between leaves log lines past the checkpoint,
        # which the resumed run truncates and then redoes, so no step or rollout is logged twice.
        (run_dir / TRACES_DIR).mkdir(exist_ok=True)
        for sample, row in zip([*samples, *abandoned_samples], rollout_rows, strict=True):
            write_json(trace_path(run_dir, row["rollout_id"]), sample.result["trace"])
        for row in rollout_rows:
            append_jsonl(run_dir / ROLLOUTS_FILE, row)
        append_jsonl(run_dir / METRICS_FILE, metrics)
        checkpoint_started = time.monotonic()
        save_train_checkpoint(
            run_dir=run_dir,
            step=new_version,
            model=model,
            tokenizer=tokenizer,
            optimizer=optimizer,
            scheduler=lr_schedule,
            data_position={
                "version": new_version,
                "counted_groups": sorted(state.counted_groups),
                "training_seconds": training_seconds(),
            },
            run_config={"stage": "async-rl", **config_data},
            metrics=metrics,
            keep_last=config.keep_checkpoints,
        )
        checkpoint_seconds = time.monotonic() - checkpoint_started
        weight_push_seconds = push_weights(new_version)
        metrics["stage_seconds"].update(checkpoint=checkpoint_seconds, weight_push=weight_push_seconds)
        history.append(metrics)
        if on_rollout is not None:
            for sample, row in zip([*samples, *abandoned_samples], rollout_rows, strict=True):
                on_rollout({**row, "trace": sample.result["trace"]})
        if on_step is not None:
            on_step(metrics)
        state.version = new_version
        return new_version

    def expert_guides(groups: list[list[RolloutSample]]) -> tuple[list, list[str]]:
        """Expert members for the groups none of whose valid rollouts passed, and why any could not be made.

        The expert runs on a rollout worker (an environment server, in the rollouts' kind of sandbox) that
        it borrows from the dispatch queue; the learner scores its tokens with the weights this update
        starts from.
        """
        guides, failures = [], []
        for group_position, group in enumerate(groups):
            valid = [sample.result["record"] for sample in group if sample.result["record"].valid]
            if not valid or any(record.passed for record in valid):
                continue
            worker, inference = idle_workers.get()
            try:
                result = ray.get(worker.expert.remote(group_index=int(group[0].request.task_key), fleet=fleet))
            except ray.exceptions.RayError as error:  # a dead worker: Ray restarts it, the group goes unguided
                result = {"error": f"rollout worker failed: {error}"}
            finally:
                idle_workers.put((worker, inference))
            if "error" in result:
                logger.warning("no expert guidance for %s: %s", group[0].request.group_id, result["error"])
                failures.append(result["error"])
                continue
            guides.append(
                expert_record_create(
                    task_id=result["task_id"], group=group_position, messages=result["messages"],
                    reward=result["reward"], tokenizer=tokenizer, model=model, temperature=update_config.temperature,
                )
            )
        return guides, failures

    def abandon_group(group: list[RolloutSample]) -> None:
        with state.abandoned_lock:
            state.abandoned_groups.append(group)

    stop = stop or threading.Event()
    # The budget's stop works like a pause: dispatching ends, the update in progress is checkpointed.
    budget_timer = (
        None if budget_seconds is None else threading.Timer(max(0.0, budget_seconds - training_seconds()), stop.set)
    )
    learner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")
    scheduler = RolloutScheduler(
        config=config.scheduler_config,
        submit_rollout=submit_rollout,
        submit_update=lambda groups, version: learner.submit(train, groups, version),
        groups=group_stream(),
        start_version=state.version,
        is_counted=lambda group_id: group_id in state.counted_groups,
        reward_of=lambda result: result["record"].reward,
        on_group_abandoned=abandon_group,
        stop=stop,
    )
    write_status(
        run_dir,
        {
            "state": "running",
            "pid": os.getpid(),
            "version": state.version,
            "rollout_worker_pids": ray.get([worker.pid.remote() for worker in workers]),
            "inference_pids": ray.get([actor.pid.remote() for actor in inference_actors]),
        },
    )
    if budget_timer is not None:
        budget_timer.daemon = True
        budget_timer.start()
    try:
        scheduler.run(steps=config.steps - state.version)
    finally:
        if budget_timer is not None:
            budget_timer.cancel()
        learner.shutdown(wait=True)
        for actor in [*workers, *inference_actors]:
            ray.kill(actor)
        if fleet is not None and fleet_started:
            fleet.shutdown()
        if owns_ray:
            ray.shutdown()
    # A stop can come while an update is in flight: the scheduler no longer waits for it, the learner's
    # shutdown above does, and that update is checkpointed, so the run's version is the learner's.
    version = max(scheduler.version, state.version)
    finished = version >= config.steps or budget_spent()
    write_status(
        run_dir, {"state": "finished" if finished else "stopped", "pid": os.getpid(), "version": version}
    )
    return history


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
    parser = argparse.ArgumentParser(description="Asynchronous GRPO driver (Ray single controller).")
    parser.add_argument("--config", required=True, help="JSON file with AsyncRLConfig fields")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = AsyncRLConfig.from_dict(json.loads(Path(args.config).read_text()))
    stop = threading.Event()
    # SIGTERM (pause, cancel, shutdown) stops dispatching; the update in progress still finishes and
    # is checkpointed, so a later start resumes exactly there.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for metrics in run_async_rl(config, stop=stop):
        logger.info("step %s: reward %s", metrics["step"], metrics["mean_reward"])


if __name__ == "__main__":
    main()
