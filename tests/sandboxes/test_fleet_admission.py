"""Admission control: full hosts queue requests, product first, tenants take turns, forks are not starved."""

import asyncio

import pytest

from sandboxes.fleet.admission import AdmissionConfig, AdmissionController, AdmissionRejected


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_full_host_queues_and_product_goes_first():
    control = AdmissionController(AdmissionConfig(slots=2))
    await control.acquire(purpose="training", tenant="exp-a")
    await control.acquire(purpose="training", tenant="exp-a")
    order = []

    async def request(purpose, tenant, label):
        await control.acquire(purpose=purpose, tenant=tenant)
        order.append(label)

    tasks = [asyncio.create_task(request("training", "exp-a", "t1")), asyncio.create_task(request("training", "exp-a", "t2"))]
    await _settle()
    tasks.append(asyncio.create_task(request("product", "user-1", "p1")))
    await _settle()
    metrics = control.metrics()
    assert (metrics.product_waiting, metrics.training_waiting) == (1, 2)
    assert order == []  # nothing failed, everything waits
    control.release(count=1)
    await _settle()
    assert order == ["p1"]  # the product request overtakes earlier training requests
    control.release(count=2)
    await asyncio.gather(*tasks)
    assert order == ["p1", "t1", "t2"]
    assert control.metrics().admitted_total == 5 and control.free_slots == 0


async def test_tenants_take_turns_within_a_class():
    control = AdmissionController(AdmissionConfig(slots=1))
    await control.acquire(purpose="training", tenant="x")
    order = []

    async def request(tenant, label):
        await control.acquire(purpose="training", tenant=tenant)
        order.append(label)
        control.release(count=1)

    tasks = [asyncio.create_task(request("burst", f"b{i}")) for i in range(4)]
    await _settle()
    tasks.append(asyncio.create_task(request("small", "s0")))
    await _settle()
    control.release(count=1)
    await asyncio.gather(*tasks)
    assert order == ["b0", "s0", "b1", "b2", "b3"]  # the late tenant is served on the next turn


async def test_large_fork_is_not_starved_and_timeouts_reject_cleanly():
    control = AdmissionController(AdmissionConfig(slots=3))
    await control.acquire(purpose="training", tenant="a", count=2)
    fork = asyncio.create_task(control.acquire(purpose="training", tenant="b", count=3))
    await _settle()
    small = asyncio.create_task(control.acquire(purpose="training", tenant="c"))
    await _settle()
    assert not fork.done() and not small.done()  # one slot is free, but the small one may not overtake
    control.release(count=2)
    await fork
    assert not small.done() and control.free_slots == 0
    with pytest.raises(AdmissionRejected, match="within 0.05s"):
        await control.acquire(purpose="product", tenant="u", timeout_s=0.05)
    assert control.metrics().product_waiting == 0
    control.release(count=3)
    await small
    with pytest.raises(AdmissionRejected, match="exceed this host's 3 slots"):
        await control.acquire(purpose="training", tenant="a", count=4)
    with pytest.raises(ValueError, match="purpose"):
        await control.acquire(purpose="batch", tenant="a")
    with pytest.raises(ValueError, match="exceed capacity"):
        control.release(count=5)
    assert control.rejected_total == 1
    assert control.metrics().wait_p95_s > 0


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="at least 1"):
        AdmissionConfig(slots=0)


async def test_reserved_slots_stay_free_for_product():
    control = AdmissionController(AdmissionConfig(slots=4, product_reserved_slots=1))
    for _ in range(3):
        await control.acquire(purpose="training", tenant="exp")
    training = asyncio.create_task(control.acquire(purpose="training", tenant="exp"))
    await _settle()
    assert not training.done() and control.free_slots == 1  # the last slot is not training's
    await asyncio.wait_for(control.acquire(purpose="product", tenant="user"), 1)  # product takes it at once
    control.release(count=1)
    await _settle()
    assert not training.done()  # the freed slot is the reserve again
    control.release(count=1)
    await asyncio.wait_for(training, 1)
    with pytest.raises(AdmissionRejected, match="3 slots training may use"):
        control.enqueue(purpose="training", tenant="exp", count=4, on_grant=lambda: None)
    with pytest.raises(ValueError, match="product_reserved_slots=4 must be within 0..3"):
        AdmissionConfig(slots=4, product_reserved_slots=4)


def test_synchronous_queue_on_a_given_clock():
    now = [100.0]
    control = AdmissionController(AdmissionConfig(slots=1), clock=lambda: now[0])
    granted: list[str] = []
    control.enqueue(purpose="training", tenant="a", on_grant=lambda: granted.append("a"))
    waiting = control.enqueue(purpose="training", tenant="b", on_grant=lambda: granted.append("b"))
    gone = control.enqueue(purpose="training", tenant="c", on_grant=lambda: granted.append("c"))
    assert granted == ["a"] and control.waiting == 2
    assert control.cancel(gone) and control.waiting == 1
    now[0] = 102.5
    control.release(count=1)
    assert granted == ["a", "b"] and not control.cancel(waiting)  # granted: the caller owns the slot
    assert control.metrics().wait_p95_s == 2.5  # waits are measured on the given clock
