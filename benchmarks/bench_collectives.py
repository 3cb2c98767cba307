"""Collective throughput per backend and tier on 2 emulated nodes × 2 ranks; prints JSON.

    python benchmarks/bench_collectives.py [--sizes-mb 0.25,4,32] [--reps 5]

Launches itself under mpirun (4 ranks, PRUNEX_RANKS_PER_NODE=2). For every backend usable here and every
tier it times an allreduce (median of --reps after a warm-up) and reports each backend's time as a ratio to
mpi's on the same tier and size, measured in the same run. Absolute seconds on a shared 2-core host say
little; the ratios and the accounted bytes are the figures to quote."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


def worker(sizes_mb, reps):
    import torch

    import prunex_hvd as px
    from prunex_hvd.dist.runtime import state
    topo = px.init(backend="auto")
    _, control = state()
    usable = [b for b in ("mpi", "gloo", "horovod") if px.comm.unavailable_reason(b, topo.launcher) is None]
    results = []
    for backend in usable:
        g = px.comm.groups(backend)
        for mb in sizes_mb:
            t = torch.randn(int(mb * 2**20) // 4)
            for tier in ("intra", "inter", "world"):
                comm = getattr(g, tier)
                member = comm is not None
                times = []
                for i in range(reps + 1):
                    g.world.barrier()
                    t0 = time.perf_counter()
                    if member:
                        comm.allreduce_(t, "avg")
                    if i:
                        times.append(time.perf_counter() - t0)
                results.append({"backend": backend, "tier": tier, "mb": mb,
                                "seconds": statistics.median(times) if member else None})
    px.comm.reset()
    rows = control.allgather_object(results)
    if topo.rank == 0:
        merged = []
        for i, r in enumerate(rows[0]):
            secs = [row[i]["seconds"] for row in rows if row[i]["seconds"] is not None]
            merged.append(dict(r, seconds=max(secs)))  # a collective ends when its slowest member does
        ref = {(r["tier"], r["mb"]): r["seconds"] for r in merged if r["backend"] == "mpi"}
        for r in merged:
            base = ref.get((r["tier"], r["mb"]))
            r["ratio_to_mpi"] = round(r["seconds"] / base, 3) if base else None
            r["seconds"] = round(r["seconds"], 6)
        print("BENCH_JSON " + json.dumps({"benchmark": "collectives", "ranks": topo.size,
                                          "nodes": topo.num_nodes, "results": merged}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="0.25,4,32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--worker", action="store_true")
    a = ap.parse_args()
    sizes = [float(s) for s in a.sizes_mb.split(",")]
    if a.worker:
        worker(sizes, a.reps)
        return
    env = dict(os.environ, PRUNEX_RANKS_PER_NODE="2", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl="self,vader,tcp",
               OMPI_MCA_btl_tcp_if_include="lo", OMPI_MCA_oob_tcp_if_include="lo")
    cmd = ["mpirun", "--oversubscribe", "-np", "4", "-x", "PRUNEX_RANKS_PER_NODE", sys.executable, HERE,
           "--worker", "--sizes-mb", a.sizes_mb, "--reps", str(a.reps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("BENCH_JSON ")), None)
    if proc.returncode or line is None:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        sys.exit(proc.returncode or 1)
    print(json.dumps(json.loads(line[len("BENCH_JSON "):]), indent=1))


if __name__ == "__main__":
    main()
