"""Free loopback ports for tests' servers and sockets, safe across processes.

A port found free is only reserved once its server binds it, which may be
seconds later (a server binds its KV event sockets before its HTTP port). So a
port is handed out once, never twice, by every test process on this machine:
the pytest-xdist workers of one run, and other runs beside it. Each handout is
written down in a registry file under a file lock, with the process that took
it; a process's ports go back to the pool when it has exited.

The ports come from below the kernel's ephemeral range (where bind-to-0 servers,
`kvserve serve --data-parallel-size`'s children included, and every outgoing
connection get theirs), so no other socket of the run takes one before its
server binds it. Each process starts at a random point of the pool, which keeps
concurrent runs apart; one still bound by anything else is skipped.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

from filelock import FileLock

REGISTRY = Path(tempfile.gettempdir()) / "kvserve-test-ports"
"""Lines of `port pid time`: what is handed out, by whom, when."""
POOL_LOW = 10000
STALE_SECONDS = 6 * 3600
"""A handout this old is free again even if its process (a pid reused) lives."""

_cursor: int | None = None


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default, and what most systems start theirs above


POOL_HIGH = max(_ephemeral_low(), POOL_LOW + 1000)
"""The pool is [POOL_LOW, POOL_HIGH): below the ephemeral range."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _take(n: int) -> int:
    """The first of n consecutive ports, free now and handed out to no live process."""
    global _cursor
    REGISTRY.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{REGISTRY}.lock"):
        now = time.time()
        held: dict[int, str] = {}
        if REGISTRY.exists():
            for line in REGISTRY.read_text().splitlines():
                port, pid, when = line.split()
                if _alive(int(pid)) and now - float(when) < STALE_SECONDS:
                    held[int(port)] = line
        if _cursor is None:
            _cursor = random.randrange(POOL_LOW, POOL_HIGH)
        size = POOL_HIGH - POOL_LOW
        for _ in range(size):
            base = _cursor
            _cursor = POOL_LOW + (_cursor - POOL_LOW + 1) % size
            ports = range(base, base + n)
            if ports[-1] >= POOL_HIGH or any(p in held for p in ports):
                continue
            if all(map(_is_free, ports)):
                _cursor = POOL_LOW + (ports[-1] + 1 - POOL_LOW) % size
                held.update({p: f"{p} {os.getpid()} {now}" for p in ports})
                tmp = REGISTRY.with_suffix(f".{os.getpid()}")
                tmp.write_text("".join(f"{line}\n" for line in held.values()))
                os.replace(tmp, REGISTRY)
                return base
    raise RuntimeError(f"no {n} consecutive free ports in [{POOL_LOW}, {POOL_HIGH})")


def free_port() -> int:
    """A free port that no other call, in this process or another, was given."""
    return _take(1)


def free_ports(n: int) -> int:
    """The first of n consecutive free ports (data-parallel ranks offset ports by one each)."""
    return _take(n)
