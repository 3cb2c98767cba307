"""Entry point for ``prunex-hvd train`` inside the emulated cluster (see ``benchmarks/emulated_cluster.py``).

The same as the ``prunex-hvd`` console script, plus two things:

* ``PXC_CONTROL_PLANE=mpi`` makes the library's launcher discovery act as on a host without Horovod (control
  plane and node discovery over mpi4py), so a method that sends no tensor through Horovod does not start
  Horovod's background thread, whose negotiation messages (~20 KB/s per host, measured) would cross the
  inter-node links without being part of any collective. Tensors go through the same mpi4py communicators
  either way (backend ``auto`` on CPU under MPI).
* after a successful run, rank 0 writes ``<out>/ledger.json``: every rank's full accounting ledger
  (``prunex_hvd.dist.comm.summary(by_op=True)``). ``metrics.jsonl``'s ``inter_bytes`` is a method's *training*
  traffic; the ledger also holds the collectives that are not (the initial model broadcast, tagged
  ``broadcast-init``, and evaluation bookkeeping, tagged ``eval``), all of which the kernel sees too.
  ``cross_rack_bytes`` (in total and per ``by_tier_op`` entry) is the part whose ring successor is in another
  rack (``--nodes-per-rack``; without racks every node is its own rack and it equals ``cross_node_bytes``).
"""
import json
import os
import sys

if os.environ.get("PXC_CONTROL_PLANE") == "mpi":
    from prunex_hvd.dist import launch

    launch.horovod_installed = lambda: False

from prunex_hvd.app.cli import main  # noqa: E402


def _out_dir(argv):
    for i, a in enumerate(argv):
        if a == "--out" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--out="):
            return a.split("=", 1)[1]
    return None


def dump_ledger(out):
    from mpi4py import MPI

    from prunex_hvd.dist.comm import accounting

    comm = MPI.COMM_WORLD
    rows = comm.gather(accounting.summary(by_op=True), root=0)
    if comm.Get_rank() != 0 or out is None:
        return
    by_op = {}
    for row in rows:
        for tier, t in row.items():   # every tier (with racks also "rack" and "spine"); "total" has no by_op
            for op, v in t.get("by_op", {}).items():
                acc = by_op.setdefault(f"{tier}:{op}", {"ops": 0, "payload_bytes": 0, "cross_node_bytes": 0,
                                                        "cross_rack_bytes": 0})
                for k in acc:
                    acc[k] += v[k]
    doc = {"cross_node_bytes": sum(r["total"]["cross_node_bytes"] for r in rows),
           "cross_rack_bytes": sum(r["total"]["cross_rack_bytes"] for r in rows), "by_tier_op": by_op,
           "ranks": rows}
    tmp = os.path.join(out, "ledger.json.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, os.path.join(out, "ledger.json"))


if __name__ == "__main__":
    rc = main()
    if rc in (0, None) and len(sys.argv) > 1 and sys.argv[1] == "train":
        dump_ledger(_out_dir(sys.argv))
    sys.exit(rc)
