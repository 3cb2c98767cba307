"""What the engine's component tests share: a small model, a topology seen from one rank, and the state a component
reads, built without any transport (the components take it, and a fake exchange where they need one)."""
import torch
import torch.nn as nn

from prunex_hvd.dist.topology import Topology
from prunex_hvd.engine.config import ConsensusConfig, Structure
from prunex_hvd.engine.state import ConsensusState


def chain(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 6, 3, padding=1), nn.Flatten(), nn.Linear(6 * 4 * 4, 5))


def topology(num_nodes: int = 2, local_size: int = 1, rank: int = 0) -> Topology:
    nodes = tuple(tuple(range(i * local_size, (i + 1) * local_size)) for i in range(num_nodes))
    node = rank // local_size
    return Topology(rank=rank, size=num_nodes * local_size, local_rank=rank % local_size, local_size=local_size,
                    node=node, num_nodes=num_nodes, node_ranks=nodes, launcher="single", grouping="override")


def state(model: nn.Module = None, topo: Topology = None, **knobs) -> ConsensusState:
    """A started state under the recipe with ``knobs`` on top (``rho_max`` a number)."""
    model = model if model is not None else chain()
    config = ConsensusConfig(**{"sparsity": "channel:0.5", "rho_max": 10.0, **knobs})
    s = ConsensusState(model, topo or topology(), config, Structure.resolve(model, config))
    s.start()
    return s


class Ledger:
    """Counts nothing; enough for the components that tag or read the ledger."""

    def tagged(self, tag):
        import contextlib
        return contextlib.nullcontext()

    def summary(self, by_op=True):
        return {"total": {"cross_node_bytes": 0, "wire_bytes": 0, "cross_rack_bytes": 0}}
