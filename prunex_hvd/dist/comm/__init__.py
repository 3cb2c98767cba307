"""Collectives on the intra-node group, the leaders' inter-node group and the world, with accounting.

    import prunex_hvd as px
    topo = px.init()
    g = px.comm.groups()            # the init backend's groups (collective: every rank calls it)
    g.intra.allreduce_(t, "sum")    # within my node
    if topo.is_leader:
        g.inter.allreduce_(t, "avg")  # across nodes, leaders only
    px.comm.summary()               # bytes and seconds per tier

Backends, one module each: ``mpi`` (mpi4py), ``gloo`` and ``nccl`` (torch.distributed), ``horovod``
(process sets); ``auto`` picks nccl for CUDA tensors, mpi for CPU tensors under MPI, gloo otherwise.
For tests and debugging, :mod:`prunex_hvd.dist.comm.threads` runs M×P ranks as threads of one process (not a
launch backend: ``thread_cluster`` builds its groups directly).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from .accounting import CommLedger, CommRecord, ledger, reset, summary, tagged
from .base import Communicator, Groups

BACKENDS = ("auto", "mpi", "gloo", "nccl", "horovod")


class BackendUnavailable(RuntimeError):
    """The backend exists but cannot run in this job (no CUDA for nccl, no MPI launch for mpi, ...)."""

_groups: Dict[str, Groups] = {}
_job: Optional[Tuple[Any, Any, str]] = None   # (topology, control plane, default backend), bound by init()


def check_backend_name(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")


def unavailable_reason(backend: str, launcher: str) -> Optional[str]:
    """Why ``backend`` cannot run in this process, or ``None`` if it can (a local check, no communication)."""
    check_backend_name(backend)
    if backend == "auto":
        from .auto import cpu_backend
        return unavailable_reason(cpu_backend(launcher), launcher)
    if backend == "mpi":
        from ..launch import describe, launched_by_mpi
        if launcher != "single" and not launched_by_mpi():
            return (f"the mpi backend needs a launch by mpirun/srun or horovodrun --mpi (this job was started "
                    f"by {describe(launcher)}): use backend='gloo' or 'horovod'")
        try:
            import mpi4py  # noqa: F401
        except ImportError as exc:
            return f"mpi4py is not importable: {exc}"
        return None
    if backend == "gloo":
        from .gloo import available
        return available()
    if backend == "nccl":
        from .nccl import available
        return available()
    from .horovod import available
    return available(launcher)


def groups(backend: Optional[str] = None) -> Groups:
    """The world / intra / inter groups of ``backend`` (default: the one given to ``init``).

    Built once per backend and cached. Building is collective: call it on every rank, in the same order."""
    if _job is None:
        raise RuntimeError("prunex_hvd is not initialised: call prunex_hvd.init() first")
    topo, control, default = _job
    backend = backend or default
    if backend not in _groups:
        _groups[backend] = _build(backend, topo, control)
    return _groups[backend]


def _build(backend: str, topo, control) -> Groups:
    check_backend_name(backend)
    control.agree(unavailable_reason(backend, topo.launcher), BackendUnavailable)
    if topo.size == 1 and backend != "nccl":
        from .base import SingleCommunicator
        one = lambda tier: SingleCommunicator(tier, [0], [0], 0)  # noqa: E731
        return Groups(world=one("world"), intra=one("intra"), inter=one("inter"), backend=backend)
    if backend == "auto":
        from .auto import combine, cpu_backend
        cuda = groups("nccl") if unavailable_reason("nccl", topo.launcher) is None else None  # CUDA present
        return combine(groups(cpu_backend(topo.launcher)), cuda)
    if backend == "mpi":
        from .mpi import make_groups
        return make_groups(topo)
    if backend == "gloo":
        from .gloo import make_groups
    elif backend == "nccl":
        from .nccl import make_groups
    else:
        from .horovod import make_groups
    return make_groups(topo, control)


def bind(topo, control, backend: str) -> None:
    """The job :func:`groups` builds for (``prunex_hvd.init`` binds it; the runtime sits above this package)."""
    global _job
    _groups.clear()
    _job = (topo, control, backend)


def unbind() -> None:
    """Forget the job and its groups (``prunex_hvd.shutdown``)."""
    global _job
    _groups.clear()
    _job = None


__all__ = ["BACKENDS", "BackendUnavailable", "CommLedger", "CommRecord", "Communicator", "Groups", "bind", "groups",
           "ledger", "reset", "summary", "tagged", "unavailable_reason", "unbind"]
