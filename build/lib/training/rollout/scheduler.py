"""Continuous rollout scheduling with a bounded policy-version lag.

One loop owns the control flow. Rollouts are submitted to workers as futures (a thread pool in the
benchmark, Ray actor calls via `ObjectRef.future()` in the driver), the first one to finish is
handled at once, and a freed worker gets new work immediately, so one slow rollout never holds the
others back. Policy updates are futures too: generation keeps running while the learner trains.

Staleness is bounded twice: admission control never lets groups of more than
`(version + max_staleness + 1) * rollouts_per_step` rollouts in total be started, and a sample whose
dispatch version lags the current one by more than `max_staleness` when it finishes is dropped
(recorded, not trained on) and its slot in the group is dispatched again. With `max_staleness=0`
the same loop degenerates into classic synchronous batches, which is what the benchmark compares.

With `probe_size` set, a group is dispatched in two parts: its first `probe_size` rollouts, and the rest
only once those disagree. A group whose probe rollouts all earned the same reward is abandoned (handed to
`on_group_abandoned`, never trained on): its task is most likely all-fail or all-pass for this policy,
and a GRPO group without reward variance has zero advantage everywhere, so finishing it would spend
generation on a zero gradient. This is DAPO's dynamic sampling (Yu et al., 2025) with an early exit: DAPO
finishes every group and then filters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field


class SchedulerConfigError(ValueError):
    """Contradictory scheduler settings; the message says how to fix them."""


@dataclass(frozen=True)
class SchedulerConfig:
    """How many rollouts run at once, how they form training steps, and how stale they may be."""

    max_in_flight: int = 8
    """Rollouts running at the same time; set it to the number of rollout workers."""
    group_size: int = 4
    """Rollouts per task in one GRPO group (advantages are computed within a group)."""
    groups_per_step: int = 2
    """Complete groups consumed by one policy update."""
    max_staleness: int = 1
    """Largest allowed lag (policy versions) between a sample's generation and its training step;
    0 means fully synchronous: generate a batch, train, repeat."""
    probe_size: int = 0
    """Rollouts of a group run first; the group is abandoned when they all earn the same reward
    (0 disables probing: every group runs to completion and is trained on)."""

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "group_size", "groups_per_step"):
            if getattr(self, name) < 1:
                raise SchedulerConfigError(f"SchedulerConfig.{name} must be >= 1")
        if self.max_staleness < 0:
            raise SchedulerConfigError("SchedulerConfig.max_staleness must be >= 0 (0 = synchronous)")
        if self.probe_size < 0 or self.probe_size == 1 or self.probe_size >= self.group_size:
            raise SchedulerConfigError(
                f"SchedulerConfig.probe_size must be 0 (no probing) or between 2 and group_size - 1 = "
                f"{self.group_size - 1}, got {self.probe_size}: one rollout cannot disagree with itself, "
                "and a probe of the whole group is the group"
            )

    @property
    def rollouts_per_step(self) -> int:
        return self.group_size * self.groups_per_step


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout to run: slot `sample_index` of the group for `task_key`."""

    rollout_id: str
    """Unique id; a rollout that is re-dispatched gets a new one, so nothing is counted twice."""
    group_id: str
    """Id of the GRPO group (one task in one step's worth of sampling)."""
    task_key: str
    """Which task to run (a toy seed, a real-tier id)."""
    sample_index: int
    """Position inside the group."""


@dataclass
class RolloutSample:
    """A finished rollout with its scheduling record."""

    request: RolloutRequest
    result: object
    """Whatever the worker returned (reward, tokens, trace)."""
    policy_version: int
    """Policy version the rollout was generated with."""
    consumed_version: int = -1
    """Version current when the sample was accepted or dropped."""
    dispatched_at: float = 0.0
    finished_at: float = 0.0
    dropped_stale: bool = False

    @property
    def staleness(self) -> int:
        return self.consumed_version - self.policy_version


@dataclass
class SchedulerStats:
    """Counters of one scheduler run, for dashboards and the benchmark."""

    dispatched: int = 0
    accepted: int = 0
    dropped_stale: int = 0
    failed: int = 0
    abandoned_groups: int = 0
    """Groups whose probe rollouts all earned the same reward (probe_size > 0)."""
    abandoned_rollouts: int = 0
    updates: int = 0
    busy_seconds: float = 0.0
    """Sum over rollouts of their dispatch-to-finish time: worker time spent on rollouts."""
    started_at: float = field(default_factory=time.monotonic)
    finished_at: float = 0.0
    staleness_histogram: dict[int, int] = field(default_factory=dict)

    @property
    def wall_seconds(self) -> float:
        return (self.finished_at or time.monotonic()) - self.started_at


SubmitRollout = Callable[[RolloutRequest, int], Future]
"""(request, policy_version) -> future of the rollout result."""
SubmitUpdate = Callable[[list[list[RolloutSample]], int], Future]
"""(groups, current_version) -> future of the new policy version."""


class RolloutScheduler:
    """Runs rollouts continuously and hands complete groups to the learner in steps."""

    def __init__(
        self,
        *,
        config: SchedulerConfig,
        submit_rollout: SubmitRollout,
        submit_update: SubmitUpdate,
        groups: Iterator[tuple[str, str]],
        start_version: int = 0,
        is_counted: Callable[[str], bool] = lambda group_id: False,
        on_rollout: Callable[[RolloutSample], None] | None = None,
        reward_of: Callable[[object], float | None] | None = None,
        on_group_abandoned: Callable[[list[RolloutSample]], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        if config.probe_size and reward_of is None:
            raise SchedulerConfigError(
                "probe_size > 0 needs reward_of (how to read a rollout result's reward); pass it or set "
                "probe_size=0"
            )
        self.config = config
        self._submit_rollout = submit_rollout
        self._submit_update = submit_update
        self._groups = groups
        self._is_counted = is_counted
        self._on_rollout = on_rollout
        self._reward_of = reward_of
        self._on_group_abandoned = on_group_abandoned
        self._stop = stop or threading.Event()
        self.version = start_version
        self._base_version = start_version
        self.stats = SchedulerStats()
        self._pending: list[RolloutRequest] = []
        self._partial: dict[str, list[RolloutSample]] = {}
        self._ready: list[list[RolloutSample]] = []
        self._retries: dict[str, int] = {}
        # Groups still in their probe: the requests held back until the probe disagrees.
        self._held: dict[str, list[RolloutRequest]] = {}
        self._committed = 0
        """Rollouts of the groups admitted so far (abandoned and skipped groups given back)."""

    def _next_request(self) -> RolloutRequest | None:
        if not self._pending:
            try:
                group_id, task_key = next(self._groups)
            except StopIteration:
                return None
            self._partial[group_id] = []
            self._committed += self.config.group_size
            requests = [
                RolloutRequest(
                    rollout_id=f"{group_id}/s{index}",
                    group_id=group_id,
                    task_key=task_key,
                    sample_index=index,
                )
                for index in range(self.config.group_size)
            ]
            probe = self.config.probe_size
            if probe:
                self._held[group_id] = requests[probe:]
                requests = requests[:probe]
            self._pending.extend(requests)
        return self._pending.pop(0)

    def _redispatch(self, request: RolloutRequest) -> None:
        attempt = self._retries.get(request.group_id + str(request.sample_index), 0) + 1
        self._retries[request.group_id + str(request.sample_index)] = attempt
        base = request.rollout_id.split("~", 1)[0]
        self._pending.insert(
            0,
            RolloutRequest(
                rollout_id=f"{base}~r{attempt}",
                group_id=request.group_id,
                task_key=request.task_key,
                sample_index=request.sample_index,
            ),
        )

    def _admission_open(self) -> bool:
        # Admission is per group: a group's whole size is committed when it starts, so the rollouts a
        # probe holds back (and re-dispatches of dropped or failed ones) always fit the budget.
        if self._pending:
            return True
        budget = (
            self.version - self._base_version + self.config.max_staleness + 1
        ) * self.config.rollouts_per_step
        return self._committed + self.config.group_size <= budget

    def run(self, *, steps: int) -> SchedulerStats:
        """Run until `steps` policy updates have finished (or the groups run out / stop is set)."""
        if steps < 1:
            raise SchedulerConfigError("steps must be >= 1")
        in_flight: dict[Future, RolloutSample] = {}
        update_future: Future | None = None
        target_version = self.version + steps
        exhausted = False
        while self.version < target_version and not self._stop.is_set():
            while not exhausted and len(in_flight) < self.config.max_in_flight and self._admission_open():
                request = self._next_request()
                if request is None:
                    exhausted = True
                    break
                if self._is_counted(request.group_id):
                    # Already trained on before a restart: never count it twice.
                    self._partial.pop(request.group_id, None)
                    self._held.pop(request.group_id, None)
                    self._committed -= self.config.group_size
                    self._pending = [item for item in self._pending if item.group_id != request.group_id]
                    continue
                sample = RolloutSample(
                    request=request, result=None, policy_version=self.version, dispatched_at=time.monotonic()
                )
                in_flight[self._submit_rollout(request, self.version)] = sample
                self.stats.dispatched += 1

            if update_future is None:
                batch = self._take_batch()
                if batch is not None:
                    update_future = self._submit_update(batch, self.version)

            waiting = set(in_flight) | ({update_future} if update_future else set())
            if not waiting:
                break
            done, _ = wait(waiting, return_when=FIRST_COMPLETED, timeout=1.0)
            for future in done:
                if future is update_future:
                    self.version = int(future.result())
                    self.stats.updates += 1
                    update_future = None
                    continue
                sample = in_flight.pop(future)
                sample.finished_at = time.monotonic()
                self.stats.busy_seconds += sample.finished_at - sample.dispatched_at
                self._handle_finished(sample, future)

        now = time.monotonic()
        for future, sample in in_flight.items():
            # Work still running when the target is reached occupied its worker until now.
            self.stats.busy_seconds += now - sample.dispatched_at
            future.cancel()
        if update_future is not None and not self._stop.is_set():
            self.version = int(update_future.result())
            self.stats.updates += 1
        self.stats.finished_at = time.monotonic()
        return self.stats

    def _handle_finished(self, sample: RolloutSample, future: Future) -> None:
        sample.consumed_version = self.version
        error = future.exception()
        if error is not None:
            # An infrastructure failure is not a sample: retry the slot instead of scoring it.
            self.stats.failed += 1
            sample.result = error
            self._redispatch(sample.request)
        elif sample.staleness > self.config.max_staleness:
            sample.result = future.result()
            self._drop_stale(sample)
        else:
            sample.result = future.result()
            self._add_to_group(sample)
        if self._on_rollout is not None:
            self._on_rollout(sample)

    def _drop_stale(self, sample: RolloutSample) -> None:
        self.stats.dropped_stale += 1
        sample.dropped_stale = True
        self._redispatch(sample.request)

    def _add_to_group(self, sample: RolloutSample) -> None:
        group_id = sample.request.group_id
        group = self._partial.setdefault(group_id, [])
        group.append(sample)
        if group_id in self._held and len(group) == self.config.probe_size:
            rewards = [self._reward_of(item.result) for item in group]
            held = self._held.pop(group_id)
            # A masked rollout (reward None) says nothing about the task: finish the group then.
            if None not in rewards and max(rewards) - min(rewards) <= 1e-9:
                self._partial.pop(group_id)
                self._committed -= self.config.group_size
                self.stats.abandoned_groups += 1
                self.stats.abandoned_rollouts += len(group)
                if self._on_group_abandoned is not None:
                    self._on_group_abandoned(sorted(group, key=lambda item: item.request.sample_index))
                return
            # The group is worth finishing: its other rollouts go first, so it completes (and reaches
            # the learner) before its probe grows stale.
            self._pending[:0] = held
            return
        if len(group) == self.config.group_size:
            self._partial.pop(sample.request.group_id)
            self._ready.append(sorted(group, key=lambda item: item.request.sample_index))

    def _take_batch(self) -> list[list[RolloutSample]] | None:
        """The next step's groups, after re-checking every sample's lag against the current version."""
        while len(self._ready) >= self.config.groups_per_step:
            batch = self._ready[: self.config.groups_per_step]
            self._ready = self._ready[self.config.groups_per_step :]
            fresh = []
            for group in batch:
                stale = [
                    item for item in group if self.version - item.policy_version > self.config.max_staleness
                ]
                if not stale:
                    fresh.append(group)
                    continue
                self._partial[group[0].request.group_id] = [item for item in group if item not in stale]
                for item in stale:
                    item.consumed_version = self.version
                    self._drop_stale(item)
            if len(fresh) < self.config.groups_per_step:
                self._ready = fresh + self._ready
                return None
            for group in fresh:
                for item in group:
                    item.consumed_version = self.version
                    self.stats.accepted += 1
                    self.stats.staleness_histogram[item.staleness] = (
                        self.stats.staleness_histogram.get(item.staleness, 0) + 1
                    )
            return fresh
        return None
