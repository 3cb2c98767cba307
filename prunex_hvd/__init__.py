"""prunex_hvd: distributed CNN training with Hierarchical Structured ADMM (PruneX) over the real cluster
topology. Structured pruning that shrinks what crosses the inter-node links.

    import prunex_hvd as px
    topo = px.init()          # rank, node, leader; groups over mpi / gloo / nccl / horovod
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), model, sparsity="channel:0.5")
"""
import logging

from . import elastic
from .batchnorm import recalibrate_batchnorm
from .dist import comm
from .dist.runtime import init, is_initialized, shutdown, topology
from .dist.topology import Topology, TopologyError
from .engine import sparsity
from .engine.config import ConsensusConfig
from .optimizer import DistributedOptimizer

# what a user wants in a log (freezing, ρ changes, refused rounds), on rank 0; silent unless the application
# configures logging (the prunex-hvd command does)
logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"
__all__ = ["ConsensusConfig", "DistributedOptimizer", "Topology", "TopologyError", "comm", "elastic", "init", "is_initialized",
           "recalibrate_batchnorm", "shutdown", "sparsity", "topology"]
