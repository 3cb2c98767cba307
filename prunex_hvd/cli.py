"""``prunex-hvd``: the command line.

    prunex-hvd info [--backend B] [--ranks-per-node N] [--probe-mb MB] [--json]
        under any launcher: the topology every rank sees, the backends usable here, and with --probe-mb a
        real collective on each tier with its accounted bytes.
"""
from __future__ import annotations

import argparse
import json
import sys


def _info(args) -> int:
    import torch

    import prunex_hvd as px
    from prunex_hvd.runtime import state

    topo = px.init(backend=args.backend, ranks_per_node=args.ranks_per_node)
    _, control = state()
    usable = {b: px.comm.unavailable_reason(b, topo.launcher) or "ok" for b in px.comm.BACKENDS}
    probe = None
    if args.probe_mb:
        g = px.comm.groups()
        t = torch.ones(int(args.probe_mb * 2**20) // 4)
        px.comm.reset()
        g.intra.allreduce_(t, "sum")          # the node's sum
        if topo.is_leader:
            g.inter.allreduce_(t, "avg")      # leaders average across nodes
        g.intra.broadcast_(t, root=0)         # and hand it back to their node
        probe = px.comm.summary()
    rows = control.allgather_object({"topology": topo.as_dict(), "probe": probe})
    if topo.rank != 0:
        return 0
    if args.json:
        print(json.dumps({"launcher": topo.launcher, "grouping": topo.grouping, "backends": usable,
                          "ranks": rows}, indent=2))
        return 0
    print(f"{topo.size} ranks on {topo.num_nodes} node(s) × {topo.local_size}; launcher {topo.launcher}, "
          f"nodes by {topo.grouping}, backend {args.backend}")
    print(f"{'rank':>4} {'node':>4} {'local':>5} {'leader':>6}" + ("   inter-node MB sent   intra MB" if probe else ""))
    for row in rows:
        t, p = row["topology"], row["probe"]
        line = f"{t['rank']:>4} {t['node']:>4} {t['local_rank']:>5} {'yes' if t['is_leader'] else '':>6}"
        if p:
            line += f"   {p['total']['cross_node_bytes'] / 2**20:>18.2f}   {p['intra']['payload_bytes'] / 2**20:>8.2f}"
        print(line)
    print("backends: " + "; ".join(f"{b}: {why}" for b, why in usable.items()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="prunex-hvd", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="topology, usable backends, and an optional probe of each tier")
    info.add_argument("--backend", default="auto")
    info.add_argument("--ranks-per-node", type=int, default=None,
                      help="emulate nodes: node = rank // N (same as env PRUNEX_RANKS_PER_NODE)")
    info.add_argument("--probe-mb", type=float, default=0.0,
                      help="run a hierarchical allreduce of this many MB and show the bytes per tier")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=_info)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as exc:
        print(f"prunex-hvd: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
