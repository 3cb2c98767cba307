"""``prunex_hvd.init()``: discover the topology once per process and keep it."""
from __future__ import annotations

import atexit
import os
from typing import Optional, Tuple

from . import comm, watchdog
from .launch import Control, detect, make_control
from .topology import (Topology, TopologyError, group_nodes, requested_nodes_per_rack, requested_ranks_per_node,
                       slurm_rack_key)

_topology: Optional[Topology] = None
_control: Optional[Control] = None
_backend: Optional[str] = None
_args: Optional[tuple] = None
_forming = False   # prunex_hvd.elastic is forming the nodes (init() is refused otherwise under elastic horovodrun)


def init(backend: str = "auto", ranks_per_node: Optional[int] = None, timeout: Optional[float] = None,
         nodes_per_rack: Optional[int] = None) -> Topology:
    """Discover rank, node and leadership, check every rank agrees, and build ``backend``'s groups.

    Discovery order: Horovod (when installed and launched by horovodrun or MPI), MPI (mpi4py), torchrun's
    environment, else a single process. ``ranks_per_node`` (or env ``PRUNEX_RANKS_PER_NODE``) overrides the
    node grouping: node = rank // ranks_per_node, so emulated nodes can share one host under mpirun.
    ``nodes_per_rack`` (or env ``PRUNEX_NODES_PER_RACK``) groups consecutive nodes into racks; without it, racks
    come from Slurm's switch topology (``SLURM_TOPOLOGY_ADDR``) where it is set, else every node is its own rack.

    ``timeout`` (or env ``PRUNEX_TIMEOUT_S``, default 600 s, 0: off): how long any collective may wait before
    the watchdog stops the job, naming the ranks that did not arrive; a rank that died is named within about a
    second (:mod:`prunex_hvd.dist.watchdog`).

    Collective: every rank must call it. Any problem (an unknown backend, an unavailable one, nodes of
    different sizes, ranks that disagree about the override) raises the same error on every rank."""
    global _topology, _control, _backend, _args
    comm.check_backend_name(backend)  # same answer on every rank: safe to raise before talking
    if elastic_launch() and not _forming:
        raise RuntimeError("under horovodrun's elastic mode (--host-discovery-script) the nodes are formed inside "
                           "a function decorated with @prunex_hvd.elastic.run, and again whenever they change: "
                           "build the model and the DistributedOptimizer without prunex_hvd.init(), then call "
                           "that function with a prunex_hvd.elastic.State")
    if _topology is not None:
        if _args == (backend, ranks_per_node, timeout, nodes_per_rack):
            return _topology
        raise RuntimeError(f"prunex_hvd is already initialised with backend={_args[0]!r}, "
                           f"ranks_per_node={_args[1]!r}, timeout={_args[2]!r}, nodes_per_rack={_args[3]!r}; "
                           "call prunex_hvd.shutdown() first")
    launcher = detect()
    control = make_control(launcher)
    try:
        rpn, npr, error = requested_ranks_per_node(ranks_per_node), requested_nodes_per_rack(nodes_per_rack), None
    except TopologyError as exc:  # reported collectively, so the ranks that parsed fine do not hang
        rpn, npr, error = None, None, str(exc)
    control.agree(error, TopologyError)
    reports = control.allgather_object((control.node_key(), rpn, npr, slurm_rack_key()))
    topo = group_nodes(control.rank, reports, launcher=launcher, grouping=control.grouping)
    _topology, _control, _backend, _args = topo, control, backend, (backend, ranks_per_node, timeout, nodes_per_rack)
    try:
        watchdog.start(control, topo.rank, topo.size, timeout)
        comm.bind(topo, control, backend)
        comm.groups(backend)
    except Exception:
        shutdown()
        raise
    atexit.register(_close_torch_distributed)
    return topo


def elastic_launch() -> bool:
    """Started by ``horovodrun`` in elastic mode (``--host-discovery-script`` / ``--min-np``)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def launcher_rank() -> int:
    """This process's rank as the launcher numbers it now (before :func:`init`: for saying things once)."""
    for var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def requested_racks() -> bool:
    """Whether racks were asked for (``PRUNEX_NODES_PER_RACK``)."""
    return requested_nodes_per_rack(None) is not None


def form(backend: str = "auto", timeout: Optional[float] = None) -> Topology:
    """Elastic training: (re)discover the nodes over the processes Horovod has now and build ``backend``'s groups
    (collective over them). No watchdog: a lost rank is Horovod's and Gloo's to report, and a collective that
    outlasts ``timeout`` (or env ``PRUNEX_TIMEOUT_S``) fails, which counts as a loss."""
    global _forming
    shutdown()
    _close_torch_distributed()
    watchdog.set_collective_timeout(watchdog.timeout_s(timeout))
    _forming = True
    try:
        return init(backend, timeout=0)
    finally:
        _forming = False


def release() -> None:
    """Elastic training, before a change of nodes: forget the topology and take torch.distributed's groups down,
    which closes their connections, so a peer blocked on this rank fails now (the caller drops its own
    references to the groups first)."""
    import gc
    shutdown()
    gc.collect()
    _close_torch_distributed()
    gc.collect()


def finish() -> None:
    """Collective, for a clean end of a job: every rank waits for the others to finish their work, then the
    watchdog and torch.distributed's groups go down while the interpreter is whole and no peer is still
    talking. Left to ``atexit``, a rank that finishes first tears Gloo down while the others are busy, and a
    finished torchrun rank once aborted in that teardown. A no-op when not initialised."""
    if _control is None:
        return
    _control.allgather_object(None)   # the barrier: nobody is mid-collective past here
    shutdown()
    _close_torch_distributed()


def _close_torch_distributed() -> None:
    """At exit, take torch.distributed's process groups down before the interpreter does: left to static
    destruction, Gloo's threads can abort a finished process ("terminate called without an active exception",
    seen once under torchrun), which the launcher reports as a failed job."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:   # exiting anyway: nothing left to protect
        pass


def state() -> Tuple[Topology, Control]:
    if _topology is None:
        raise RuntimeError("prunex_hvd is not initialised: call prunex_hvd.init() first")
    return _topology, _control


def topology() -> Topology:
    return state()[0]


def default_backend() -> str:
    state()
    return _backend


def is_initialized() -> bool:
    return _topology is not None


def shutdown() -> None:
    """Forget the topology and groups (the launcher's own runtime stays up)."""
    global _topology, _control, _backend, _args
    watchdog.stop()
    comm.unbind()
    _topology = _control = _backend = _args = None
