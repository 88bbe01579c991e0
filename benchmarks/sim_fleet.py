"""A thousand-host sandbox fleet on a simulated clock, driving the real admission and placement code.

No processes and no Ray: every host is a real ``sandboxes.fleet.admission.AdmissionController`` on a
simulated clock, and every request is placed by the real ``sandboxes.fleet.placement`` functions the
fleet client uses (ask ``placement_choices`` random hosts for their load, ``host_pick`` the best).
Only the sandboxes' work is simulated: each one holds its slot for a drawn duration.

Traffic: product (cloud-agent) requests arrive as a Poisson stream whose rate follows a daily curve
(peak at 15:00, trough at 03:00), from many users; training comes in episodes of RL bursts, each
burst 10,000 rollouts from one experiment (the experiments take turns), with lognormal (heavy-tailed)
durations. Mid-way through the first episode a new host joins.

Three policies run on the same seeded traffic:
* ``fifo`` (baseline): every request is one tenant's training request, no product reserve: a plain
  first-come first-served queue on each host;
* ``priority``: the admission classes (product first, tenants round-robin), no reserve;
* ``priority+reserve``: the same with ``product_reserved_slots`` per host kept for product.

"During bursts" means while some training request waits anywhere in the fleet (demand exceeds the
slots training may use). Run:  .venv/bin/python benchmarks/sim_fleet.py [--small] [--json]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandboxes.fleet.admission import AdmissionConfig, AdmissionController
from sandboxes.fleet.placement import HostLoad, host_pick, placement_candidates

SHARE_WINDOW_S = 60.0
"""Round robin is judged per minute of contention: over a whole run every tenant gets its turn in the end."""


@dataclass(frozen=True)
class SimConfig:
    """The simulated fleet and its traffic."""

    hosts: int = 1000
    slots: int = 64
    placement_choices: int = 8
    reserved_slots: int = 3
    """``product_reserved_slots`` of the ``priority+reserve`` policy."""
    start_hour: float = 11.0
    """Time of day the simulated window starts (the daily curve's phase)."""
    hours: float = 3.0
    product_peak_per_s: float = 8.0
    """Product arrivals per second at the daily peak (15:00); 10 % of that at 03:00."""
    product_users: int = 200
    product_median_s: float = 240.0
    product_sigma: float = 0.8
    product_max_s: float = 1800.0
    experiments: int = 6
    burst_rollouts: int = 10_000
    bursts_per_episode: int = 12
    burst_interval_s: float = 60.0
    episode_starts_s: tuple[float, ...] = (1200.0,)
    rollout_median_s: float = 900.0
    rollout_sigma: float = 1.0
    rollout_max_s: float = 3600.0
    join_at_s: float = 1500.0
    """When the extra host joins (mid-way through the first episode)."""
    seed: int = 47

    @classmethod
    def small(cls) -> SimConfig:
        """A fleet small enough for a unit test (about a second per policy), with the same shape."""
        return cls(hosts=30, slots=32, placement_choices=4, reserved_slots=2, hours=1.5, product_peak_per_s=0.4,
                   product_users=20, experiments=3, burst_rollouts=600, bursts_per_episode=6, burst_interval_s=30.0,
                   episode_starts_s=(600.0, 3000.0), rollout_median_s=120.0, rollout_max_s=900.0,
                   product_median_s=60.0, product_max_s=600.0, join_at_s=720.0)


@dataclass(frozen=True)
class PolicyResult:
    """What one admission policy did with the traffic."""

    policy: str
    product_requests: int
    training_requests: int
    product_wait_p50_s: float
    """Median admission wait of product requests submitted during bursts."""
    product_wait_p99_s: float
    product_wait_p99_all_s: float
    """p99 over every product request of the run, bursts or not."""
    burst_seconds: float
    """Simulated seconds during which some training request waited."""
    utilisation_in_bursts: float
    """Slots in use / slots in the fleet, time-averaged over the burst seconds."""
    tenant_share_max_min: float
    """Round robin: in each minute with several experiments deeply backlogged (as many requests waiting
    as there are hosts), the largest over the smallest ratio of such an experiment's grants to its fair
    share; the median over those minutes (1.0 is perfect; inf: in most such minutes one got nothing)."""
    joined_host_first_grant_s: float
    """Seconds from the host joining to its first admitted sandbox (inf: never)."""
    joined_host_full_s: float
    """Seconds from joining until it ran 90 % of the slots its policy lets it fill (inf: never)."""
    joined_during_burst: bool
    scheduler_cpu_s: float
    """Process CPU time spent inside placement and admission (enqueue, grant, release) calls."""
    scheduler_cpu_s_per_10k: float
    """The same per 10,000 requests."""
    sim_cpu_s: float
    """CPU time of the whole simulated run of this policy (the event loop included)."""


@dataclass(frozen=True)
class SimReport:
    config: SimConfig
    results: tuple[PolicyResult, ...]
    product_p99_ratio_fifo_over_reserve: float
    """How many times longer the baseline's product p99 is than the reserve policy's."""


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def _median_share_ratio(actual: dict[int, dict[str, float]], expected: dict[int, dict[str, float]]) -> float:
    ratios = []
    for window, fair in expected.items():
        if sum(fair.values()) < 20:
            continue
        got = [actual[window].get(name, 0.0) / share for name, share in fair.items() if share >= 1.0]
        if len(got) >= 2:
            ratios.append(max(got) / min(got) if min(got) > 0 else math.inf)
    if not ratios:
        return math.nan
    ratios.sort()
    return ratios[len(ratios) // 2]


def product_rate(config: SimConfig, t: float) -> float:
    """Product arrivals per second at simulated second ``t``: the daily curve."""
    hour = (config.start_hour + t / 3600.0) % 24.0
    return config.product_peak_per_s * (0.55 + 0.45 * math.cos(2 * math.pi * (hour - 15.0) / 24.0))


@dataclass
class _Host:
    name: str
    admission: AdmissionController
    load: HostLoad
    joined_at: float = 0.0
    first_grant_at: float = math.inf
    full_at: float = math.inf


@dataclass
class _Stats:
    product_waits_burst: list[float] = field(default_factory=list)
    product_waits_all: list[float] = field(default_factory=list)
    burst_seconds: float = 0.0
    used_slot_seconds: float = 0.0
    fleet_slot_seconds: float = 0.0
    share_actual: dict[int, dict[str, float]] = field(default_factory=dict)
    share_expected: dict[int, dict[str, float]] = field(default_factory=dict)
    scheduler_cpu_s: float = 0.0
    product_requests: int = 0
    training_requests: int = 0


class FleetSim:
    """One policy's run: an event heap, the hosts, and the counters the result is made from."""

    def __init__(self, config: SimConfig, policy: str) -> None:
        if policy not in ("fifo", "priority", "priority+reserve"):
            raise ValueError(f"policy={policy!r}; use fifo, priority or priority+reserve")
        self.config = config
        self.policy = policy
        self.reserved = config.reserved_slots if policy == "priority+reserve" else 0
        self.now = 0.0
        self.events: list[tuple[float, int, str, tuple]] = []
        self.sequence = itertools.count()
        self.traffic = random.Random(config.seed)  # arrivals and durations: identical for every policy
        self.placement_rng = random.Random(config.seed + 1)
        self.hosts: dict[str, _Host] = {}
        self.names: list[str] = []
        self.used = 0
        self.training_waiting: dict[str, int] = {}
        self.backlogged = 0
        self.stats = _Stats()
        self.last_t = 0.0
        for index in range(config.hosts):
            self._host_add(f"host-{index:04d}")

    # Fleet ----------------------------------------------------------------------------------------

    def _host_add(self, name: str) -> _Host:
        admission = AdmissionController(
            AdmissionConfig(slots=self.config.slots, max_waiting=10**9, product_reserved_slots=self.reserved),
            clock=lambda: self.now)
        host = _Host(name, admission, HostLoad(name=name, slots=self.config.slots, free=self.config.slots,
                                                reserved=self.reserved), joined_at=self.now)
        self.hosts[name] = host
        self.names.append(name)
        return host

    def _refresh(self, host: _Host) -> None:
        load, admission = host.load, host.admission
        load.free, load.waiting, load.product_waiting = (
            admission.free_slots, admission.waiting, admission.product_waiting)

    def _schedule(self, at: float, kind: str, payload: tuple = ()) -> None:
        heapq.heappush(self.events, (at, next(self.sequence), kind, payload))

    # Requests -------------------------------------------------------------------------------------

    def submit(self, *, purpose: str, tenant: str, duration_s: float) -> None:
        in_burst = self.backlogged > 0
        if self.policy == "fifo":
            queue_purpose, queue_tenant = "training", "fifo"
        else:
            queue_purpose, queue_tenant = purpose, tenant
        submitted_at = self.now
        started = time.process_time()
        candidates = placement_candidates(names=self.names, choices=self.config.placement_choices,
                                          rng=self.placement_rng)
        load = host_pick(loads=[self.hosts[name].load for name in candidates], count=1, purpose=queue_purpose)
        host = self.hosts[load.name]
        if purpose == "training":
            self.stats.training_requests += 1
            if self.training_waiting.get(tenant, 0) == 0:
                self.backlogged += 1
            self.training_waiting[tenant] = self.training_waiting.get(tenant, 0) + 1
        else:
            self.stats.product_requests += 1

        def granted() -> None:
            self._granted(host=host, purpose=purpose, tenant=tenant, submitted_at=submitted_at,
                          in_burst=in_burst, duration_s=duration_s)

        host.admission.enqueue(purpose=queue_purpose, tenant=queue_tenant, count=1, on_grant=granted)
        self._refresh(host)
        self.stats.scheduler_cpu_s += time.process_time() - started

    def _granted(self, *, host: _Host, purpose: str, tenant: str, submitted_at: float, in_burst: bool,
                 duration_s: float) -> None:
        self.used += 1
        wait = self.now - submitted_at
        if purpose == "product":
            self.stats.product_waits_all.append(wait)
            if in_burst:
                self.stats.product_waits_burst.append(wait)
        else:
            self._share_count(tenant)
            self.training_waiting[tenant] -= 1
            if self.training_waiting[tenant] == 0:
                self.backlogged -= 1
        if host.first_grant_at == math.inf:
            host.first_grant_at = self.now
        if host.full_at == math.inf and host.admission.used_slots >= 0.9 * (self.config.slots - self.reserved):
            host.full_at = self.now
        self._schedule(self.now + duration_s, "finish", (host.name,))

    def _share_count(self, tenant: str) -> None:
        # Only tenants with a deep backlog (one waiting request per host on average) compete: one with a
        # handful left waits on a few hosts and cannot take a fleet-wide share, however fair the turns.
        deep = len(self.hosts)
        backlogged = [name for name, waiting in self.training_waiting.items() if waiting >= deep]
        if len(backlogged) < 2 or tenant not in backlogged:
            return
        window = int(self.now // SHARE_WINDOW_S)
        actual = self.stats.share_actual.setdefault(window, {})
        expected = self.stats.share_expected.setdefault(window, {})
        actual[tenant] = actual.get(tenant, 0.0) + 1.0
        for name in backlogged:
            expected[name] = expected.get(name, 0.0) + 1.0 / len(backlogged)

    def finish(self, host_name: str) -> None:
        host = self.hosts[host_name]
        self.used -= 1
        started = time.process_time()
        host.admission.release(count=1)
        self._refresh(host)
        self.stats.scheduler_cpu_s += time.process_time() - started

    # Traffic --------------------------------------------------------------------------------------

    def _lognormal(self, median_s: float, sigma: float, max_s: float) -> float:
        return min(max_s, max(1.0, self.traffic.lognormvariate(math.log(median_s), sigma)))

    def _next_product(self) -> None:
        # Thinning: candidate arrivals at the peak rate, each kept with probability rate(t) / peak.
        peak = self.config.product_peak_per_s
        t = self.now
        while True:
            t += self.traffic.expovariate(peak)
            if self.traffic.random() * peak <= product_rate(self.config, t):
                break
        user = f"user-{self.traffic.randrange(self.config.product_users)}"
        duration = self._lognormal(self.config.product_median_s, self.config.product_sigma, self.config.product_max_s)
        self._schedule(t, "product", (user, duration))

    def _burst(self, experiment: str) -> None:
        config = self.config
        for _ in range(config.burst_rollouts):
            self.submit(purpose="training", tenant=experiment,
                        duration_s=self._lognormal(config.rollout_median_s, config.rollout_sigma, config.rollout_max_s))

    def _plan(self) -> None:
        config = self.config
        burst_index = 0
        for start in config.episode_starts_s:
            for step in range(config.bursts_per_episode):
                experiment = f"exp-{burst_index % config.experiments}"
                self._schedule(start + step * config.burst_interval_s, "burst", (experiment,))
                burst_index += 1
        self._schedule(config.join_at_s, "join")
        self._next_product()

    # Run ------------------------------------------------------------------------------------------

    def _advance(self, t: float) -> None:
        dt = t - self.last_t
        if dt > 0 and self.backlogged > 0:
            self.stats.burst_seconds += dt
            self.stats.used_slot_seconds += self.used * dt
            self.stats.fleet_slot_seconds += self.config.slots * len(self.hosts) * dt
        self.last_t = t
        self.now = t

    def run(self) -> PolicyResult:
        started = time.process_time()
        self._plan()
        end = self.config.hours * 3600.0
        joined: _Host | None = None
        joined_in_burst = False
        while self.events and self.events[0][0] <= end:
            at, _, kind, payload = heapq.heappop(self.events)
            self._advance(at)
            if kind == "finish":
                self.finish(*payload)
            elif kind == "product":
                user, duration = payload
                self.submit(purpose="product", tenant=user, duration_s=duration)
                self._next_product()
            elif kind == "burst":
                self._burst(*payload)
            elif kind == "join":
                joined_in_burst = self.backlogged > 0
                joined = self._host_add("host-joined")
        return self._result(joined, joined_in_burst, time.process_time() - started)

    def _result(self, joined: _Host | None, joined_in_burst: bool, sim_cpu_s: float) -> PolicyResult:
        stats = self.stats
        share = _median_share_ratio(stats.share_actual, stats.share_expected)
        requests = stats.product_requests + stats.training_requests
        return PolicyResult(
            policy=self.policy,
            product_requests=stats.product_requests,
            training_requests=stats.training_requests,
            product_wait_p50_s=_percentile(stats.product_waits_burst, 0.50),
            product_wait_p99_s=_percentile(stats.product_waits_burst, 0.99),
            product_wait_p99_all_s=_percentile(stats.product_waits_all, 0.99),
            burst_seconds=stats.burst_seconds,
            utilisation_in_bursts=stats.used_slot_seconds / stats.fleet_slot_seconds if stats.fleet_slot_seconds else 0.0,
            tenant_share_max_min=share,
            joined_host_first_grant_s=(joined.first_grant_at - joined.joined_at) if joined else math.inf,
            joined_host_full_s=(joined.full_at - joined.joined_at) if joined else math.inf,
            joined_during_burst=joined_in_burst,
            scheduler_cpu_s=stats.scheduler_cpu_s,
            scheduler_cpu_s_per_10k=stats.scheduler_cpu_s / requests * 10_000 if requests else 0.0,
            sim_cpu_s=sim_cpu_s,
        )


POLICIES = ("fifo", "priority", "priority+reserve")


def simulate(config: SimConfig, policies: tuple[str, ...] = POLICIES) -> SimReport:
    results = tuple(FleetSim(config, policy).run() for policy in policies)
    by_policy = {result.policy: result for result in results}
    ratio = math.nan
    if "fifo" in by_policy and "priority+reserve" in by_policy:
        reserve_p99 = by_policy["priority+reserve"].product_wait_p99_s
        ratio = by_policy["fifo"].product_wait_p99_s / reserve_p99 if reserve_p99 > 0 else math.inf
    return SimReport(config=config, results=results, product_p99_ratio_fifo_over_reserve=ratio)


def _print(report: SimReport) -> None:
    config = report.config
    print(f"fleet: {config.hosts} hosts x {config.slots} slots, {config.hours:g} h from {config.start_hour:g}:00, "
          f"bursts of {config.burst_rollouts} rollouts, seed {config.seed}")
    header = ("policy", "product", "training", "p50 s", "p99 s", "p99 all s", "burst s", "util",
              "share max/min", "join 1st s", "join 90% s", "sched cpu s", "cpu s/10k", "sim cpu s")
    print(" | ".join(header))
    for r in report.results:
        print(" | ".join([
            r.policy, str(r.product_requests), str(r.training_requests), f"{r.product_wait_p50_s:.3f}",
            f"{r.product_wait_p99_s:.3f}", f"{r.product_wait_p99_all_s:.3f}", f"{r.burst_seconds:.0f}",
            f"{r.utilisation_in_bursts:.3f}", f"{r.tenant_share_max_min:.3f}", f"{r.joined_host_first_grant_s:.2f}",
            f"{r.joined_host_full_s:.1f}", f"{r.scheduler_cpu_s:.2f}", f"{r.scheduler_cpu_s_per_10k:.3f}",
            f"{r.sim_cpu_s:.1f}"]))
    print(f"product p99 during bursts, fifo baseline / priority+reserve: {report.product_p99_ratio_fifo_over_reserve:.1f}x")


def main(argv: list[str] | None = None) -> SimReport:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the small fleet of the unit test")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    config = SimConfig.small() if args.small else SimConfig()
    if args.seed is not None:
        config = replace(config, seed=args.seed)
    report = simulate(config)
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        _print(report)
    return report


if __name__ == "__main__":
    main()
