"""An experiment on a 3-node Ray test cluster (slow: a few minutes on 2 shared cores).

The driver's rollout workers, inference actors and sandbox hosts spread over the nodes; a node is
removed mid-experiment. Its in-flight rollouts end as masked infrastructure failures (never a zero
reward) or are re-dispatched (their worker died with the node), and the experiment finishes with
every rollout counted once. A node that joins then gets a sandbox host from the driver's own fleet
(the driver started it: no ``fleet_serve`` runs here).
"""

from __future__ import annotations

import threading
import time

import pytest

from training.checkpoint import create_random_checkpoint

NODE = {"num_cpus": 1, "object_store_memory": 78 * 2**20}


@pytest.mark.slow
def test_an_experiment_survives_losing_a_node_and_counts_every_rollout_once(tmp_path):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from training.rollout.driver import METRICS_FILE, ROLLOUTS_FILE, AsyncRLConfig, read_jsonl, run_async_rl

    checkpoint = create_random_checkpoint(tmp_path / "policy", "tiny", seed=0, max_seq_len=4096)
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "resources": {"sandbox_slots": 2}})
    workers = [cluster.add_node(**NODE, resources={"sandbox_slots": 2}) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    run_dir = tmp_path / "run"
    config = AsyncRLConfig(
        run_dir=str(run_dir), init_checkpoint=str(checkpoint), steps=4, tasks=8, group_size=2, groups_per_step=2,
        max_staleness=1, rollout_workers=6, inference_actors=3, max_turns=2, max_tokens_per_turn=8,
        sandbox_hosts=True, fleet_heartbeats=False,
    )
    seen: dict = {}
    outcome: dict = {}

    def experiment() -> None:  # in a thread: Ray adds nodes only from the main thread (signal handlers)
        try:
            outcome["history"] = run_async_rl(config)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test below
            outcome["error"] = exc
        outcome["finished_at"] = time.monotonic()

    runner = threading.Thread(target=experiment, daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and runner.is_alive() and not read_jsonl(run_dir / METRICS_FILE):
            time.sleep(0.5)
        alive = [actor for actor in list_actors(filters=[("state", "=", "ALIVE")])
                 if actor.class_name in ("RolloutServer", "InferenceServer", "SandboxHost")]
        seen["nodes"] = {name: {a.node_id for a in alive if a.class_name == name}
                         for name in ("RolloutServer", "InferenceServer", "SandboxHost")}
        cluster.remove_node(workers[0])
        seen["removed_after_step"] = len(read_jsonl(run_dir / METRICS_FILE))
        joined = cluster.add_node(**NODE, resources={"sandbox_slots": 2})
        while time.monotonic() < deadline and runner.is_alive() and "joined_host" not in seen:
            hosts = list_actors(filters=[("state", "=", "ALIVE"), ("class_name", "=", "SandboxHost")])
            if any(actor.node_id == joined.node_id for actor in hosts):
                seen["joined_host"] = time.monotonic()
            time.sleep(0.5)
        runner.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        ray.shutdown()
        cluster.shutdown()

    assert not runner.is_alive(), "the experiment did not finish within 10 minutes"
    if "error" in outcome:
        raise outcome["error"]
    history = outcome["history"]
    assert [row["step"] for row in history] == [1, 2, 3, 4]
    assert seen["removed_after_step"] < 4, "the node must go while the experiment runs"
    assert seen.get("joined_host", float("inf")) < outcome["finished_at"], "the node that joined got no sandbox host"
    # Spread: every kind of actor on more than one node, a sandbox host on each of the 3.
    assert len(seen["nodes"]["SandboxHost"]) == 3
    assert len(seen["nodes"]["RolloutServer"]) >= 2 and len(seen["nodes"]["InferenceServer"]) >= 2
    rows = read_jsonl(run_dir / ROLLOUTS_FILE)
    ids = [row["rollout_id"] for row in rows]
    assert len(ids) == len(set(ids)), "a rollout was counted twice"
    groups = [(row["group_id"], row["sample_index"]) for row in rows]
    assert len(groups) == len(set(groups)), "a group member was counted twice"
    for row in rows:
        if not row["valid"]:  # the lost node's rollouts: masked, never scored zero
            assert row["reward"] is None and row["status"].startswith("infrastructure"), row
    metrics = read_jsonl(run_dir / METRICS_FILE)
    assert sum(row["rollouts"] for row in metrics) == len([row for row in rows if not row["abandoned"]])
