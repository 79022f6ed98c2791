"""Local TCP ports (no network traffic): what the launcher, the benchmarks and the tests use
to pick a port to listen on."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LISTEN_LOW = 10000  # ports below are left to well-known services


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports (Linux
    ``net.ipv4.ip_local_port_range``; 32768-60999, Linux's default, where it is unreadable)."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now, for a server about to listen on it.

    It is drawn at random below the kernel's ephemeral range (:func:`ephemeral_range`), so an
    outgoing connection cannot take it between this call and the server's bind (a port the
    kernel picks with ``bind(host, 0)`` can be). The port is released before this returns:
    two callers that draw the same port at once are possible but rare, and one bind fails.
    Falls back to the kernel's pick when the range below leaves no room.

    Raises:
        OSError: ``host`` is not an address of this machine.
    """
    low, _ = ephemeral_range()
    rng = random.SystemRandom()
    if low - LISTEN_LOW >= 1000:
        for _ in range(200):
            port = rng.randrange(LISTEN_LOW, low)
            if _bindable(host, port):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
