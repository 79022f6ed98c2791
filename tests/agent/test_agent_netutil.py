"""free_port: a listenable port below the kernel's ephemeral range, so no outgoing
connection can take it before the server binds it."""

from __future__ import annotations

import socket

from tierwatch.agent import netutil


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    low, high = netutil.ephemeral_range()
    assert 1024 <= low < high <= 65535
    for _ in range(20):
        port = netutil.free_port()
        assert netutil.LISTEN_LOW <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_busy_port_is_never_returned(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        monkeypatch.setattr(netutil, "LISTEN_LOW", taken)
        monkeypatch.setattr(netutil, "ephemeral_range", lambda: (taken + 1000, 60999))
        ports = {netutil.free_port() for _ in range(50)}
    assert taken not in ports


def test_no_room_below_the_range_falls_back_to_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(netutil, "ephemeral_range", lambda: (netutil.LISTEN_LOW + 10, 60999))
    port = netutil.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
