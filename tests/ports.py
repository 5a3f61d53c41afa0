"""Loopback ports for servers the tests start on a fixed port (and restart on it).

A port comes from below the kernel's range of ephemeral ports: a port from that range
(bind to port 0) could be handed to any outgoing connection, or to a server another
test process starts on port 0, while ours is down between a SIGKILL and its restart.
Ports are drawn from the operating system's randomness, not ``random``'s generator,
which a test may seed: two test processes seeded alike would draw the same ports.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port", "free_port_run", "free_ports"]

_DRAW = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _draw(low: int) -> int:
    return _DRAW.randrange(10000, low) if low > 11000 else _DRAW.randrange(low - 1000, low)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now, below the ephemeral range."""
    low = _ephemeral_low()
    out: list[int] = []
    for _ in range(1000):  # bounded: nearly every port there is free
        if len(out) == n:
            return out
        port = _draw(low)
        if port not in out and _free(port):
            out.append(port)
    raise RuntimeError(f"no {n} free ports below {low}")


def free_port_run(n: int) -> int:
    """The first of ``n`` consecutive loopback ports free now, below the ephemeral
    range (``kvcoord serve --replicas n`` listens on a port and the ``n - 1`` after it)."""
    low = _ephemeral_low() - n
    for _ in range(1000):  # bounded
        first = _draw(low)
        if all(_free(first + i) for i in range(n)):
            return first
    raise RuntimeError(f"no {n} consecutive free ports below {low + n}")


def free_port() -> int:
    """One loopback port free now, below the ephemeral range."""
    return free_ports(1)[0]
