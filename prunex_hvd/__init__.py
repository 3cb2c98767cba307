"""prunex_hvd: distributed CNN training with Hierarchical Structured ADMM (PruneX) over the real cluster
topology. Structured pruning that shrinks what crosses the inter-node links.

    import prunex_hvd as px
    topo = px.init()          # rank, node, leader; groups over mpi / gloo / nccl / horovod
"""
from . import comm
from .runtime import init, is_initialized, shutdown, topology
from .topology import Topology, TopologyError

__version__ = "0.1.0"
__all__ = ["Topology", "TopologyError", "comm", "init", "is_initialized", "shutdown", "topology"]
