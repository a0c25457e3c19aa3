"""The order in which a rank runs relayed parts (``rank/world/relay_order.py``)."""

from __future__ import annotations

from axon_nb.rank.world.relay_order import Order


def test_a_part_that_comes_early_waits_for_those_before_it() -> None:
    order: Order[str] = Order()
    assert order.admit("e", 2, "B") == []
    assert order.admit("e", 3, "C") == []
    assert order.waiting("e") == 2
    assert order.admit("e", 1, "A") == ["A", "B", "C"]
    assert order.admit("e", 4, "D") == ["D"]
    assert order.waiting("e") == 0


def test_skipped_numbers_release_the_parts_after_them_and_are_dropped_if_they_come() -> None:
    order: Order[str] = Order()
    assert order.admit("e", 3, "C") == []
    assert order.skip("e", [1]) == []
    assert order.skip("e", [2]) == ["C"]
    assert order.admit("e", 2, "late") == []  # (the kernel settled it: it must not run)
    assert order.skip("e", [4]) == []  # a skip ahead of its turn is kept
    assert order.admit("e", 4, "late too") == []
    assert order.admit("e", 5, "E") == ["E"]


def test_each_relay_counts_on_its_own() -> None:
    order: Order[str] = Order()
    assert order.admit("first", 1, "A") == ["A"]
    assert order.admit("second", 1, "B") == ["B"]  # (a new client, or a new relay)
    assert order.admit("first", 3, "C") == []
    assert order.admit("second", 2, "D") == ["D"]
