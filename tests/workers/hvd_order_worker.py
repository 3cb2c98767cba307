"""A Horovod user's script under horovodrun, with ``hvd.init()`` and ``px.init()`` in the order ``--order`` names
(or one of them left out). The script does what Horovod scripts do around the wrap: broadcast_parameters, a
metric averaged with hvd.allreduce, and it trains two rounds. Writes OUT/rank{R}.json with the topology and
the final model's digest, or, when the order is one PruneX refuses, "[rank R] hvd-order worker error: ..."."""
import argparse
import hashlib
import os
import sys

import torch
import torch.nn as nn

import worker_io

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models_for_tests import toy_cnn  # noqa: E402

ORDERS = {   # name: (calls before the wrap, in order; the wrapper's backend)
    "hvd-then-px": (["hvd", "px"], "auto"),
    "px-then-hvd": (["px", "hvd"], "auto"),
    "hvd-only": (["hvd"], "auto"),
    "neither": ([], "auto"),
    "hvd-dynamic-then-px-horovod": (["hvd-dynamic", "px-horovod"], "horovod"),
    "px-horovod-then-hvd": (["px-horovod", "hvd"], "horovod"),
    "hvd-then-px-horovod": (["hvd", "px-horovod"], "horovod"),   # refused: Horovod without dynamic sets
    "hvd-only-wrap-horovod": (["hvd"], "horovod"),                # refused likewise, at the wrap
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--order", required=True, choices=sorted(ORDERS))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import horovod.torch as hvd
    import prunex_hvd as px
    calls, backend = ORDERS[a.order]
    for call in calls:
        if call == "hvd":
            hvd.init()
        elif call == "hvd-dynamic":
            hvd.init(process_sets="dynamic")
        elif call == "px":
            px.init()
        else:
            px.init(backend="horovod")
    if "hvd" not in " ".join(calls):
        hvd.init()   # a script with no hvd.init() before the wrap calls Horovod's API after it
    model = toy_cnn(hvd.rank())   # different weights on every rank: broadcast_parameters makes them equal
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                  sparsity="channel:0.5", local_steps=2, backend=backend)
    g = torch.Generator().manual_seed(hvd.rank())
    for _ in range(4):
        x, y = torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    mean_loss = hvd.allreduce(loss.detach(), name="loss").item()   # Horovod's metric averaging, after PruneX's
    opt.finalize()
    topo = px.topology()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    worker_io.report(a.out, hvd.rank(), {"rank": hvd.rank(), "size": hvd.size(), "nodes": topo.num_nodes,
                                         "backend": px.comm.groups().backend, "rounds": opt.rounds_done(),
                                         "mean_loss": mean_loss, "digest": digest}, 1)


if __name__ == "__main__":
    worker_io.run(main, "hvd-order")
