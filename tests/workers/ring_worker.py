"""MPI's async allreduce (a ring of polled sends and receives on the group's communication thread) against its
blocking allreduce, on every group of a 2 nodes × 2 launch: the world (4 members), the leaders (2), a node (2).

    mpirun -np 4 python ring_worker.py --out DIR

For each dtype, op and length (0, shorter than the group, not a multiple of it, long) both allreduces run on
the same input. Every member must end with the same result. It must be the blocking one's bits where only one
order of adds exists (2 members, max, integers); elsewhere (float sums on 4 members) it must equal the float64
sum computed here up to the rounding of each add. Two async
allreduces are in flight at once while the node group runs blocking collectives, as the overlapped round's
leaders exchange while their node steps. Writes OUT/rank{R}.json."""
import argparse

import torch

import worker_io

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.uint8)


def values(member: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * member + n)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 50, (n,), generator=g).to(dtype)


def check_group(comm, name: str, others) -> int:
    checks = 0
    for dtype in DTYPES:
        for op in ("sum", "avg", "max") if dtype.is_floating_point else ("sum", "max"):
            for n in (0, 1, comm.size + 1, 1001):
                blocking, in_flight = values(comm.rank, n, dtype), values(comm.rank, n, dtype)
                comm.allreduce_async_(in_flight, op).wait()
                comm.allreduce_(blocking, op)
                what = f"{name} {dtype} {op} n={n}"
                for q, theirs in enumerate(comm.allgather(in_flight, same_shape=True)):
                    assert torch.equal(theirs, in_flight), f"{what}: member {q} ends with another result"
                if comm.size == 2 or op == "max" or not dtype.is_floating_point:
                    # one add per element, or no rounding: any algorithm gives the same bits
                    assert torch.equal(in_flight, blocking), f"{what}: async {in_flight[:5]} blocking {blocking[:5]}"
                else:   # summed in another order than MPI's own algorithm: equal up to the rounding of each add
                    inputs = torch.stack([values(q, n, dtype) for q in range(comm.size)]).double()
                    want = inputs.sum(0) / (comm.size if op == "avg" else 1)
                    eps = torch.finfo(dtype).eps * comm.size * float(inputs.abs().max()) if n else 0.0
                    worker_io.assert_close(in_flight.double(), want, what, atol=4 * eps, rtol=0)
                checks += 1
    first, second = values(comm.rank, 5000, torch.float32), values(comm.rank, 7, torch.bfloat16)
    works = [comm.allreduce_async_(first, "sum"), comm.allreduce_async_(second, "max")]
    node_collectives(others)
    for work in works:
        work.wait()
    worker_io.assert_close(first, sum(values(q, 5000, torch.float32) for q in range(comm.size)), f"{name} pair")
    assert torch.equal(second, torch.stack([values(q, 7, torch.bfloat16) for q in range(comm.size)]).max(0).values)
    return checks + 2


def node_collectives(group) -> None:
    """What a group runs while another's async allreduces are in flight (a node's steps with node_sync)."""
    side = torch.ones(3)
    for _ in range(3):
        group.allreduce_(side, "sum")
    assert torch.equal(side, torch.full((3,), float(group.size ** 3)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import prunex_hvd as px
    topo = px.init(backend="mpi", ranks_per_node=2)
    g = px.comm.groups("mpi")
    checks = check_group(g.world, "world", g.intra) + check_group(g.intra, "intra", g.world)
    if g.inter is not None:
        checks += check_group(g.inter, "inter", g.intra)
    else:   # the node's other rank joins the node collectives its leader runs during the exchange
        node_collectives(g.intra)
    worker_io.report(a.out, topo.rank, {"checks": checks}, checks)


if __name__ == "__main__":
    worker_io.run(main, "ring")
