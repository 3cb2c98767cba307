"""Resume the way a Horovod user saves: a user's script around the wrapped optimizer on a real launch.

Trains one round, then every rank saves ``opt.state_dict()`` to OUT/opt.rank{R}.pt and rank 0 also to OUT/opt.pt
(Horovod's habit: save on rank 0). Every rank loading rank 0's file must be refused on every rank, nothing loaded
(each rank's error written to OUT/error.rank{R}.txt); every rank loading its own file must take it, its state
equal to what it saved, and the job trains on. Writes OUT/rank{R}.json."""
import argparse
import os
import sys

import torch

import worker_io

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models_for_tests import toy_cnn, toy_train  # noqa: E402


def engine_tensors(opt):
    return {(name, key): value for name, entry in opt.state_dict()["prunex"]["entries"].items()
            for key, value in entry.items() if isinstance(value, torch.Tensor)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import prunex_hvd as px
    topo = px.init(backend=a.backend)
    model = toy_cnn(topo.rank)
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                  sparsity="channel:0.5", local_steps=2, backend=a.backend)
    toy_train(model, opt, 2, seed=topo.rank)
    own = os.path.join(a.out, f"opt.rank{topo.rank}.pt")
    torch.save(opt.state_dict(), own)
    if topo.rank == 0:
        torch.save(opt.state_dict(), os.path.join(a.out, "opt.pt"))
    saved = engine_tensors(opt)
    px.comm.groups().world.barrier()   # rank 0's file is whole before anyone reads it
    try:
        opt.load_state_dict(torch.load(os.path.join(a.out, "opt.pt")))
    except ValueError as exc:
        with open(os.path.join(a.out, f"error.rank{topo.rank}.txt"), "w") as f:
            f.write(str(exc))
    else:
        raise AssertionError("rank 0's state was loaded on every rank")
    if any(not torch.equal(t, saved[k]) for k, t in engine_tensors(opt).items()):
        raise AssertionError("the refused load changed the state")
    opt.load_state_dict(torch.load(own))
    if any(not torch.equal(t, saved[k]) for k, t in engine_tensors(opt).items()):
        raise AssertionError("a rank's own state did not load as saved")
    toy_train(model, opt, 2, seed=topo.rank)
    worker_io.report(a.out, topo.rank, {"rounds": opt.rounds_done()}, 1)


if __name__ == "__main__":
    worker_io.run(main, "resume")
