"""This host's network side: the address other ranks reach it at, and a free port (rank 0's rendezvous for
torch.distributed, and the watchdog's hub)."""
from __future__ import annotations

import os
import socket


def reachable_address() -> str:
    """An address of this host that the other ranks can reach (used by rank 0 for torch.distributed).

    ``PRUNEX_MASTER_ADDR`` or ``MASTER_ADDR`` win; under horovodrun the interface that routes to the
    launcher's rendezvous server; else the host name's address."""
    for var in ("PRUNEX_MASTER_ADDR", "MASTER_ADDR"):
        if os.environ.get(var):
            return os.environ[var]
    target = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    if target:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((target, int(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", 1))))
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError:
        return "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
