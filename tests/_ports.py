"""Free loopback ports for tests' servers and sockets.

A port found free is only reserved once its server binds it, which may be
seconds later (a server binds its KV event sockets before its HTTP port).
Two ports asked one after the other could be the same number: the kernel
hands out a port that was just closed again. So a port is handed out once
per test run, never twice.
"""

from __future__ import annotations

import random
import socket

_handed_out: set[int] = set()


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free port no earlier call of this run returned."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def free_ports(n: int) -> int:
    """The first of n consecutive free ports (data-parallel ranks offset ports by one each)."""
    for _ in range(200):
        base = random.randrange(20000, 60000)
        ports = range(base, base + n)
        if not _handed_out.intersection(ports) and all(map(_is_free, ports)):
            _handed_out.update(ports)
            return base
    raise RuntimeError("no consecutive free ports")
