"""The rack tier's groups on a real launch: 8 ranks as 2 racks × 2 nodes × 2 (PRUNEX_RANKS_PER_NODE=2,
PRUNEX_NODES_PER_RACK=2). Each rank sums its rank over its rack group (node leaders of the rack), the spine
(rack leaders) and the world, checks the sums, and writes OUT/rank{R}.json with its topology and the ledger.

``--disagree R``: instead, rank R asks ``init`` for 4 nodes a rack and the others for 2; every rank must refuse,
printing "[rank R] refused: ..." with the error."""
import argparse

import torch

import worker_io


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True)
    ap.add_argument("--disagree", type=int, default=None, metavar="RANK")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import prunex_hvd as px
    if a.disagree is not None:
        return disagree(px, a.disagree, a.out)
    topo = px.init(backend=a.backend)
    g = px.comm.groups()
    members = {}
    for tier in ("rack", "spine", "world"):
        comm = getattr(g, tier)
        if comm is None:
            continue
        t = torch.full((1000,), float(topo.rank))
        comm.allreduce_(t, "sum")
        if not t.eq(float(sum(comm.ranks))).all():
            raise AssertionError(f"{tier}: got {t[0].item()}, want the sum of ranks {list(comm.ranks)}")
        members[tier] = list(comm.ranks)
    worker_io.report(a.out, topo.rank, {"topology": topo.as_dict(), "members": members,
                                        "ledger": px.comm.summary()}, len(members))


def disagree(px, odd_rank, out):
    rank = worker_io.launch_rank()
    try:
        px.init(ranks_per_node=2, nodes_per_rack=4 if rank == odd_rank else 2)
    except px.TopologyError as exc:
        print(f"[rank {rank}] refused: {exc}", flush=True)
    else:
        raise AssertionError("ranks that disagree about nodes_per_rack were not refused")
    worker_io.report(out, rank, {}, 1)


if __name__ == "__main__":
    worker_io.run(main, "rack")
