"""Local TCP ports (no network traffic): what the launcher, the demo's tools, the benchmarks
and the tests use to pick a port to listen on."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now (the kernel's pick of an ephemeral port).

    The port is released before this returns, so another process may take it first; callers
    that bind it at once (a rendezvous, a server started right after) rarely lose that race.

    Raises:
        OSError: ``host`` is not an address of this machine.
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
