"""TCP ports for the rendezvous stores of the frameworks mpcomm is embedded in (no framework imported here)."""
from __future__ import annotations

import random
import socket

__all__ = ["free_port"]


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` now, for a rendezvous store to listen on: below the kernel's ephemeral range
    where it has one (Linux), since outgoing connections take their local ports from that range and one of them can
    take a port chosen there before the store listens (EADDRINUSE: seen in CI, where PyTorch's test suite makes a
    store per test); elsewhere one the kernel picks."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    below = random.Random().sample(range(10000, low), min(200, low - 10000)) if low > 10000 else []
    for port in below + [0]:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store binds it
            try:
                s.bind((address, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free TCP port on {address}")
