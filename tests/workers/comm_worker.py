"""Runs every collective of the given backends on this rank and checks the results against values computed
here; writes the ledger per backend to OUT/rank{R}.json for the parent test to check byte counts exactly.

    mpirun -np 4 python comm_worker.py --backends mpi,gloo --out DIR
    mpirun -np 4 -x PRUNEX_RANKS_PER_NODE=3 python comm_worker.py --try-init env,bogus,nccl --ranks-per-node 2 --out DIR
On an error, prints "[rank R] prunex_hvd error: ..." and exits 3 (the bad-launch tests read that).

``--try-init`` first makes each of the named ``prunex_hvd.init`` calls of ``TRIES`` in turn (each meant to fail
on every rank: they stay in step), writing the error caught to OUT/CASE/error.rank{R}.txt, then goes on as
without it (``init`` with the other arguments, which must still work after those failures)."""
import argparse
import os
import sys
import time
import traceback

import torch

import worker_io
from worker_io import assert_close, launch_rank


# prunex_hvd.init keyword arguments tried by --try-init, each expected to fail on every rank
TRIES = {"env": {},                                          # whatever the launch set (PRUNEX_RANKS_PER_NODE)
         "bogus": {"backend": "bogus"},
         "nccl": {"backend": "nccl", "ranks_per_node": 2}}


def error_line(exc):
    return f"[rank {launch_rank(0)}] prunex_hvd error: {type(exc).__name__}: {exc}"


def write_whole(path, text):
    """Write PATH so that it never exists half written (another rank may see it and exit, and the launcher
    then kills this one)."""
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def wait_for_every_rank_s_error(out, most_s):
    """Until every rank of the launch has written its OUT/error.rank{R}.txt (and a moment more, for the
    launcher to forward what they printed), at most ``most_s`` seconds: what a rank waits before its exit
    makes the launcher end the others. Without OUT, or without the launch's size, the whole ``most_s``."""
    size = next((int(os.environ[v]) for v in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE")
                 if v in os.environ), None)
    deadline = time.monotonic() + most_s
    while time.monotonic() < deadline:
        if out and size and all(os.path.exists(os.path.join(out, f"error.rank{r}.txt")) for r in range(size)):
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            return
        time.sleep(0.1)


def try_init(px, cases, out):
    for case in cases:
        folder = os.path.join(out, case)
        os.makedirs(folder, exist_ok=True)
        try:
            px.init(**TRIES[case])
        except Exception as exc:  # noqa: BLE001 - the parent test checks which
            with open(os.path.join(folder, f"error.rank{launch_rank(0)}.txt"), "w") as f:
                f.write(error_line(exc))
        else:
            px.shutdown()


def exercise(px, backend, topo, device):
    g = px.comm.groups(backend)
    px.comm.reset()
    r, node = topo.rank, topo.node
    local = topo.local_ranks
    f32 = dict(dtype=torch.float32, device=device)

    # intra: sum and avg
    t = torch.arange(1000, **f32) + r
    g.intra.allreduce_(t, "sum")
    assert_close(t, sum(torch.arange(1000, **f32) + q for q in local), "intra allreduce sum")
    t = torch.full((10,), float(r), dtype=torch.float64, device=device)
    g.intra.allreduce_(t, "avg")
    assert_close(t, torch.full_like(t, sum(local) / len(local)), "intra allreduce avg")

    # inter: leaders only
    if topo.is_leader:
        t = torch.arange(1000, **f32) * (node + 1)
        g.inter.allreduce_(t, "avg")
        mean = sum(n + 1 for n in range(topo.num_nodes)) / topo.num_nodes
        assert_close(t, torch.arange(1000, **f32) * mean, "inter allreduce avg")
    else:
        assert g.inter is None, "a non-leader must hold no inter-node group"

    # world
    t = torch.full((7,), r, dtype=torch.int64, device=device)
    g.world.allreduce_(t, "sum")
    assert_close(t, torch.full_like(t, sum(range(topo.size))), "world allreduce sum")
    t = torch.tensor([float(r), -float(r), 0.5, float(r % 2), 1e-3 * r], **f32)
    g.world.allreduce_(t, "max")
    n = topo.size
    assert_close(t, torch.tensor([n - 1.0, 0.0, 0.5, 1.0 if n > 1 else 0.0, 1e-3 * (n - 1)], **f32), "world allreduce max")

    # bitwise-or of masks: 0/1 masks everywhere, bit patterns where the backend has BOR
    def mask_of(q, n=33):
        m = torch.zeros(n, dtype=torch.uint8)
        m[q::4] = 1
        return m
    for tier, members in (("intra", local), ("inter", topo.leaders), ("world", range(topo.size))):
        comm = getattr(g, tier)
        if comm is None:
            continue
        m = mask_of(r).to(device)
        comm.bor_(m)
        assert_close(m.cpu(), torch.stack([mask_of(q) for q in members]).amax(0), f"{tier} bor")
    bits = torch.tensor([1 << r, 0, 255 if r == 0 else 0], dtype=torch.uint8, device=device)
    if g.world.has_bor if backend != "auto" else g.world._pick(bits).has_bor:
        g.world.bor_(bits)
        assert_close(bits.cpu(), torch.tensor([(1 << topo.size) - 1, 0, 255], dtype=torch.uint8), "world bor bits")
    else:
        try:
            g.world.bor_(bits)
        except ValueError:
            pass
        else:
            raise AssertionError("a MAX-based bor_ must refuse non-0/1 masks")

    # broadcast: intra from local rank 1, world from rank 2 (when they exist)
    t = torch.full((100,), float(r), **f32)
    g.intra.broadcast_(t, root=1 % topo.local_size)
    assert_close(t, torch.full_like(t, float(local[1 % topo.local_size])), "intra broadcast")
    t = torch.full((100,), float(r), **f32)
    g.world.broadcast_(t, root=2 % topo.size)
    assert_close(t, torch.full_like(t, float(2 % topo.size)), "world broadcast")

    # allgather: equal (declared and discovered), unequal, and on the leaders
    out = g.world.allgather(torch.full((3, 5), float(r), **f32), same_shape=True)
    assert_close(torch.stack(out), torch.stack([torch.full((3, 5), float(q), **f32) for q in range(topo.size)]),
          "world allgather same_shape")
    out = g.world.allgather(torch.full((3, 5), float(r), **f32))
    assert_close(torch.stack(out), torch.stack([torch.full((3, 5), float(q), **f32) for q in range(topo.size)]),
          "world allgather")
    out = g.world.allgather(torch.full((r + 1, 2), float(r), **f32))
    assert [tuple(o.shape) for o in out] == [(q + 1, 2) for q in range(topo.size)], "unequal allgather shapes"
    for q, o in enumerate(out):
        assert_close(o, torch.full((q + 1, 2), float(q), **f32), "world allgather unequal")
    if topo.is_leader:
        out = g.inter.allgather(torch.arange(node + 2, dtype=torch.int32, device=device))
        for n, o in enumerate(out):
            assert_close(o, torch.arange(n + 2, dtype=torch.int32, device=device), "inter allgather unequal")
    g.world.barrier()
    return px.comm.summary(by_op=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init-backend", default="auto")
    ap.add_argument("--backends", default="")
    ap.add_argument("--ranks-per-node", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--try-init", default="", help="comma-separated, before the real init: " + ", ".join(TRIES))
    a = ap.parse_args()
    tries = list(filter(None, a.try_init.split(",")))
    if tries and not a.out:
        ap.error("--try-init needs --out")
    if set(tries) - set(TRIES):
        ap.error(f"--try-init: unknown {', '.join(sorted(set(tries) - set(TRIES)))}; choose from {', '.join(TRIES)}")
    try:
        import prunex_hvd as px
        try_init(px, tries, a.out)
        topo = px.init(backend=a.init_backend, ranks_per_node=a.ranks_per_node)
        if a.device == "cuda":
            torch.cuda.set_device(topo.local_rank % torch.cuda.device_count())
        result = {"topology": topo.as_dict(), "backends": {}}
        for backend in filter(None, a.backends.split(",")):
            result["backends"][backend] = exercise(px, backend, topo, a.device)
    except Exception as exc:  # noqa: BLE001 - reported to the parent test, with the rank
        message = error_line(exc)
        if a.out:   # a file per rank: launchers may split lines of different ranks into each other
            write_whole(os.path.join(a.out, f"error.rank{launch_rank(0)}.txt"), message)
        print(message, flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        # the launcher aborts the whole job at the first non-zero exit: give every rank (on a loaded 2-core
        # CI host) time to reach its own error before this one exits
        wait_for_every_rank_s_error(a.out, most_s=8)
        sys.exit(3)
    if a.out:
        worker_io.report(a.out, topo.rank, result, len(result["backends"]))
    else:
        print(f"[rank {topo.rank}] ok {topo}", flush=True)


if __name__ == "__main__":
    main()
