"""``mpcomm.integrations.ports.free_port``: a port a rendezvous store can listen on, never one from the kernel's
ephemeral range (where the job's own outgoing connections take their local ports)."""
import socket
from pathlib import Path

import pytest

from mpcomm.integrations.ports import free_port

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not RANGE.exists() or int(RANGE.read_text().split()[0]) <= 10000,
                    reason="no ephemeral port range above 10000 to stay below")
def test_a_free_port_is_below_the_ephemeral_range_and_can_be_listened_on():
    low = int(RANGE.read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= port < low for port in ports), (ports, low)
    port = ports.pop()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
