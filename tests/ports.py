"""Ports for the tests' process groups and servers (`free_port`, imported through conftest)."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket

# Test ports come from below Linux's ephemeral range (32768-60999), each xdist worker a block
# of its own: a launch picks its trials' ports at once and uses them seconds later, and a port
# from bind(0) can meanwhile become a connection's own end (a TCPStore client then connects to
# itself and its ping fails) or another worker's bind(0). Ray's workers take 10002-19999.
PORTS = range(20000, 32768)


def _port_block() -> itertools.cycle:
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    size = len(PORTS) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return itertools.cycle(PORTS[worker * size:(worker + 1) * size])


_PORTS = _port_block()


def free_port() -> int:
    """The next port of this worker's block that nothing is bound to."""
    while True:
        port = next(_PORTS)
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("", port))
            return port
