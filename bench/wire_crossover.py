"""What compression="auto" decides on this communicator: the network its constructor measured, and per wire the
model's prediction at 64 MiB and the size from which ``Selector.wire_pays`` holds (``wire_crossover``).

    ci/cluster.sh 2 1 1gbit -- mpiexec -n 2 python bench/wire_crossover.py
"""
from __future__ import annotations

from mpcomm import Communicator
from mpcomm.bench.report import human_bytes
from mpcomm.compression import WIRES

if __name__ == "__main__":
    comm = Communicator()
    s = comm.selector
    lines = [f"layout {s.layout.node_sizes} (ranks per node), network: {s.network or 'one host (not measured)'}"]
    for wire in WIRES:
        with_wire, without = s.price_wire(wire, 64 << 20)
        crossover = s.wire_crossover(wire)
        lines.append(f"{wire}: 64 MiB predicted {with_wire * 1e3:.0f} ms against float32 {without * 1e3:.0f} ms; "
                     f"pays from {human_bytes(crossover) if crossover else 'never'}")
    if comm.rank == 0:
        print("\n".join(lines))
    comm.free()
