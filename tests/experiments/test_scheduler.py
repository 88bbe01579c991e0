"""RolloutScheduler: continuous dispatch, staleness bound, synchronous degenerate case, retries."""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from training.rollout.scheduler import RolloutScheduler, SchedulerConfig, SchedulerConfigError


class Harness:
    def __init__(self, *, config, durations, fail_ids=(), update_s=0.01, workers=None):
        self.config = config
        self.durations = durations
        self.fail_ids = set(fail_ids)
        self.update_s = update_s
        self.pool = ThreadPoolExecutor(max_workers=workers or config.max_in_flight)
        self.learner = ThreadPoolExecutor(max_workers=1)
        self.running = 0
        self.max_running = 0
        self.lock = threading.Lock()
        self.batches = []
        self.seen_ids = []
        self.execute_result = lambda request: {"reward": 1.0}

    def execute(self, request, version):
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            self.seen_ids.append(request.rollout_id)
        try:
            time.sleep(self.durations(request))
            if request.rollout_id in self.fail_ids:
                raise RuntimeError("sandbox host lost")
            return self.execute_result(request)
        finally:
            with self.lock:
                self.running -= 1

    def train(self, groups, version):
        time.sleep(self.update_s)
        self.batches.append(groups)
        return version + 1

    def scheduler(self, **kwargs):
        groups = ((f"g{index}", str(index)) for index in itertools.count())
        return RolloutScheduler(
            config=self.config,
            submit_rollout=lambda request, version: self.pool.submit(self.execute, request, version),
            submit_update=lambda groups, version: self.learner.submit(self.train, groups, version),
            groups=groups,
            **kwargs,
        )


def test_synchronous_mode_waits_for_each_batch_and_has_zero_staleness():
    config = SchedulerConfig(max_in_flight=8, group_size=2, groups_per_step=2, max_staleness=0)
    harness = Harness(config=config, durations=lambda request: 0.01)
    stats = harness.scheduler().run(steps=3)
    assert stats.updates == 3 and stats.accepted == 12
    assert harness.max_running <= config.rollouts_per_step
    assert stats.staleness_histogram == {0: 12}
    for groups in harness.batches:
        assert len(groups) == 2 and all(len(group) == 2 for group in groups)
        assert all(len({sample.request.group_id for sample in group}) == 1 for group in groups)


def test_continuous_mode_keeps_workers_busy_and_bounds_staleness():
    # One straggler per few groups: it must not hold back the others, and it gets dropped when stale.
    # Admission allows (version + max_staleness + 1) * rollouts_per_step = 6 rollouts at version 0.
    config = SchedulerConfig(max_in_flight=6, group_size=2, groups_per_step=1, max_staleness=2)

    straggler_may_finish = threading.Event()
    all_slots_busy = threading.Event()

    def durations(request):
        # The first wave holds its slots until all six run at once, so a loaded machine (a slow
        # dispatch thread) cannot let one finish first; a scheduler that admits fewer times out here.
        with harness.lock:
            if harness.running >= 6:
                all_slots_busy.set()
        if request.rollout_id == "g0/s0":
            straggler_may_finish.wait(timeout=30)
        elif request.rollout_id.split("/")[0] in {"g0", "g1", "g2"}:
            all_slots_busy.wait(timeout=10)
        return 0.01

    harness = Harness(config=config, durations=durations)
    original_train = harness.train

    def train(groups, version):
        new_version = original_train(groups, version)
        if new_version >= 4:
            straggler_may_finish.set()
        return new_version

    harness.train = train
    stats = harness.scheduler().run(steps=8)
    assert stats.updates == 8
    assert harness.max_running == 6
    trained = [sample for groups in harness.batches for group in groups for sample in group]
    assert all(0 <= sample.staleness <= 2 for sample in trained)
    assert "g0/s0" not in {sample.request.rollout_id for sample in trained}
    assert stats.dropped_stale >= 1
    assert len({sample.request.rollout_id for sample in trained}) == len(trained)


def test_failed_rollout_is_retried_under_a_new_id_not_scored():
    config = SchedulerConfig(max_in_flight=2, group_size=2, groups_per_step=1, max_staleness=0)
    harness = Harness(config=config, durations=lambda request: 0.005, fail_ids={"g0/s1"})
    stats = harness.scheduler().run(steps=1)
    (group,) = harness.batches[0]
    assert [sample.request.rollout_id for sample in group] == ["g0/s0", "g0/s1~r1"]
    assert stats.failed == 1 and stats.accepted == 2


def test_counted_groups_are_skipped_after_restart():
    config = SchedulerConfig(max_in_flight=4, group_size=2, groups_per_step=1, max_staleness=0)
    harness = Harness(config=config, durations=lambda request: 0.005)
    stats = harness.scheduler(is_counted=lambda group_id: group_id in {"g0", "g1"}, start_version=5).run(
        steps=1
    )
    assert stats.updates == 1
    assert {
        sample.request.group_id for groups in harness.batches for group in groups for sample in group
    } == {"g2"}
    assert not any(rollout_id.startswith(("g0/", "g1/")) for rollout_id in harness.seen_ids)


def test_config_errors_explain_the_fix():
    with pytest.raises(SchedulerConfigError, match="max_staleness must be >= 0"):
        SchedulerConfig(max_staleness=-1)
    with pytest.raises(SchedulerConfigError, match="group_size must be >= 1"):
        SchedulerConfig(group_size=0)


def test_probe_abandons_a_group_whose_first_rollouts_agree_and_finishes_one_whose_rollouts_disagree():
    # g0's probe all fail (reward 0), g1's probe disagree, g2's probe all pass: only g1 is trained on,
    # and g0 / g2 never run past their probe.
    config = SchedulerConfig(max_in_flight=2, group_size=4, groups_per_step=1, max_staleness=0, probe_size=2)
    rewards = {"g0": [0.0, 0.0], "g1": [1.0, 0.0, 0.0, 1.0], "g2": [1.0, 1.0]}
    harness = Harness(config=config, durations=lambda request: 0.005)
    harness.execute_result = lambda request: {
        "reward": rewards.get(request.group_id, [0.0, 1.0, 0.0, 1.0])[request.sample_index]
    }
    abandoned = []
    scheduler = harness.scheduler(reward_of=lambda result: result["reward"], on_group_abandoned=abandoned.append)
    stats = scheduler.run(steps=1)
    (group,) = harness.batches[0]
    assert [sample.request.rollout_id for sample in group] == ["g1/s0", "g1/s1", "g1/s2", "g1/s3"]
    assert [[sample.request.rollout_id for sample in group] for group in abandoned] == [["g0/s0", "g0/s1"]]
    assert not any(rollout_id.startswith("g0/s2") or rollout_id.startswith("g0/s3") for rollout_id in harness.seen_ids)
    assert stats.abandoned_groups == 1 and stats.abandoned_rollouts == 2 and stats.accepted == 4


def test_probe_with_a_masked_rollout_finishes_the_group():
    # A rollout without a reward (infrastructure failure, masked) is no evidence that the task is all-fail.
    config = SchedulerConfig(max_in_flight=2, group_size=3, groups_per_step=1, max_staleness=0, probe_size=2)
    harness = Harness(config=config, durations=lambda request: 0.005)
    harness.execute_result = lambda request: {"reward": None if request.sample_index == 0 else 0.0}
    abandoned = []
    stats = harness.scheduler(reward_of=lambda result: result["reward"], on_group_abandoned=abandoned.append).run(
        steps=1
    )
    assert not abandoned and stats.abandoned_groups == 0
    assert [sample.request.rollout_id for sample in harness.batches[0][0]] == ["g0/s0", "g0/s1", "g0/s2"]


def test_probe_config_errors_explain_the_fix():
    with pytest.raises(SchedulerConfigError, match="probe_size must be 0 .* or between 2 and group_size - 1 = 3"):
        SchedulerConfig(group_size=4, probe_size=4)
    with pytest.raises(SchedulerConfigError, match="one rollout cannot disagree with itself"):
        SchedulerConfig(group_size=4, probe_size=1)
    harness = Harness(config=SchedulerConfig(group_size=4, probe_size=2), durations=lambda request: 0.0)
    with pytest.raises(SchedulerConfigError, match="probe_size > 0 needs reward_of"):
        harness.scheduler()
