"""One process, no launcher: init works, every collective is an identity, unusable backends say why."""
import sys

import torch

import prunex_hvd as px

backend = sys.argv[1]
try:
    topo = px.init(backend=backend)
except Exception as exc:  # noqa: BLE001
    print(f"error: {type(exc).__name__}: {exc}")
    sys.exit(3)
assert (topo.rank, topo.size, topo.num_nodes, topo.is_leader, topo.launcher) == (0, 1, 1, True, "single")
g = px.comm.groups()
t = torch.arange(6, dtype=torch.float32)
g.intra.allreduce_(t, "avg")
g.inter.allreduce_(t, "sum")
g.world.broadcast_(t)
assert torch.equal(t, torch.arange(6, dtype=torch.float32))
assert [x.tolist() for x in g.world.allgather(torch.ones(2))] == [[1.0, 1.0]]
s = px.comm.summary()
assert s["total"]["ops"] == 5 and s["total"]["cross_node_bytes"] == 0 and s["total"]["wire_bytes"] == 0
print("ok", topo)
