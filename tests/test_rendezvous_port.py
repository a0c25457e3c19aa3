"""``rank/world/rendezvous_port.py``: a rendezvous port (the world's ``MASTER_PORT``, a
script's under ``%axon_run``) comes from below the range Linux hands to outgoing connections,
so no connection opened before the rendezvous listens can take it (run 24 saw a script's
``init_process_group`` fail with ``EADDRINUSE`` on a port picked by binding port 0)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from axon_nb.rank.world import rendezvous_port
from axon_nb.rank.world.rendezvous_port import LOWEST, ephemeral_start, free_port


def test_a_port_is_free_and_below_the_outgoing_connection_range() -> None:
    ports = {free_port() for _ in range(20)}
    assert all(LOWEST <= port < ephemeral_start() for port in ports), sorted(ports)
    assert len(ports) > 1  # picked at random, so two rendezvous rarely meet
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", port))  # free


def test_a_taken_port_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(rendezvous_port, "LOWEST", busy)
        monkeypatch.setattr(
            rendezvous_port, "ephemeral_start", lambda: busy + rendezvous_port.TRIES + 1
        )
        assert all(free_port() != busy for _ in range(20))


def test_no_room_below_the_range_falls_back_to_any_free_port(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text(f"{LOWEST + 10}\t60999\n")
    monkeypatch.setattr(rendezvous_port, "RANGE_FILE", str(narrow))
    assert ephemeral_start() == LOWEST + 10
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", port))
