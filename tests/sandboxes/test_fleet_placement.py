"""Placement: the least loaded host for the request's class; sampling; requests bigger than every host."""

import random

import pytest

from sandboxes.fleet.placement import HostLoad, PlacementError, host_pick, placement_candidates


def test_training_avoids_queues_and_reserve_product_only_queues_behind_product():
    busy = HostLoad(name="busy", slots=8, free=0, waiting=5, product_waiting=0, reserved=2)
    reserve_left = HostLoad(name="reserve-left", slots=8, free=2, waiting=3, product_waiting=1, reserved=2)
    open_host = HostLoad(name="open", slots=8, free=3, waiting=0, product_waiting=0, reserved=2)
    loads = [busy, reserve_left, open_host]
    assert host_pick(loads=loads, count=1, purpose="training").name == "open"
    # A product request does not care about training queues: "busy" has no product waiting but no free slot.
    assert host_pick(loads=[busy, reserve_left], count=1, purpose="product").name == "reserve-left"
    assert host_pick(loads=[busy, reserve_left], count=1, purpose="training").name == "reserve-left"


def test_requests_bigger_than_every_host_fail_with_the_size():
    loads = [HostLoad(name="a", slots=4, free=4, reserved=1), HostLoad(name="b", slots=2, free=2)]
    assert host_pick(loads=loads, count=4, purpose="product").name == "a"
    with pytest.raises(PlacementError, match="4 sandboxes exceed the largest host"):
        host_pick(loads=loads, count=4, purpose="training")  # only 3 of a's slots are training's
    with pytest.raises(ValueError, match="purpose"):
        host_pick(loads=loads, count=1, purpose="batch")


def test_candidates_sample_without_repeats_and_cover_small_fleets():
    names = [f"h{i}" for i in range(100)]
    sample = placement_candidates(names=names, choices=8, rng=random.Random(1))
    assert len(sample) == len(set(sample)) == 8 and set(sample) <= set(names)
    assert placement_candidates(names=names[:5], choices=8, rng=random.Random(1)) == names[:5]
    assert placement_candidates(names=names, choices=0, rng=random.Random(1)) == names
    seen = set()
    rng = random.Random(2)
    for _ in range(200):
        seen.update(placement_candidates(names=names, choices=8, rng=rng))
    assert len(seen) == 100  # every host gets asked sooner or later (a joining host too)
    assert HostLoad.from_dict({"host_name": "x", "slots": 4, "free": 1, "waiting": 2}).waiting == 2
