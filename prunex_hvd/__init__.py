"""prunex_hvd: distributed CNN training with Hierarchical Structured ADMM (PruneX) over the real cluster
topology. Structured pruning that shrinks what crosses the inter-node links.

    import prunex_hvd as px
    topo = px.init()          # rank, node, leader; groups over mpi / gloo / nccl / horovod
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), model, sparsity="channel:0.5")
"""
from . import comm, sparsity
from .optimizer import DistributedOptimizer
from .runtime import init, is_initialized, shutdown, topology
from .topology import Topology, TopologyError

__version__ = "0.1.0"
__all__ = ["DistributedOptimizer", "Topology", "TopologyError", "comm", "init", "is_initialized", "shutdown",
           "sparsity", "topology"]
