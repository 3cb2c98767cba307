"""Every backend's collectives on 4 ranks as 2 nodes × 2, under real launchers.

The worker checks every result against values it computes itself; here we check the ledger's byte counts
exactly against the ring model written out by hand for 2 nodes × 2 ranks (nodes [0,0,1,1], leaders 0, 2)."""

import pytest
import torch

from launching import horovodrun, mpirun, needs_horovod, needs_mpirun, python_cmd, run, torchrun, worker_results
from shared_launches import register

pytestmark = pytest.mark.launch

F32, F64, I64, U8 = 4, 8, 8, 1
SIZES_MSG = 9 * I64  # shape exchange before an allgather: (ndim, 8 dims) as int64


def expected_ledger(rank: int, backend: str) -> dict:
    """{tier: {op: (ops, payload, wire, cross)}} for one rank of the worker's sequence."""
    node, lr = divmod(rank, 2)
    leader = lr == 0
    padded = backend in ("gloo", "nccl")          # torch.distributed pads unequal allgathers
    native_bor = backend in ("mpi", "gloo")       # nccl / horovod OR by MAX and refuse the bit pattern
    crosses = rank in (1, 3)                      # world ring 0→1→2→3→0: 1→2 and 3→0 leave the node
    mask = 33 * (4 if backend == "horovod" else 1)  # Horovod reduces no uint8: masks travel as int32
    exp = {"intra": {
        "allreduce": (2, 1000 * F32 + 10 * F64, 1000 * F32 + 10 * F64, 0),   # n=2: each sends B
        "bor": (1, mask, mask, 0),
        "broadcast": (1, 100 * F32, 100 * F32 if lr == 1 else 0, 0),          # chain from root 1
    }}
    if leader:
        mine = 12 if padded else 4 * (node + 2)
        exp["inter"] = {
            "allreduce": (1, 1000 * F32, 1000 * F32, 1000 * F32),
            "bor": (1, mask, mask, mask),
            "allgather_sizes": (1, SIZES_MSG, SIZES_MSG, SIZES_MSG),
            "allgather": (1, mine, mine, mine),   # n=2: forwards only its own block
        }
    bor_bytes = [33, 3] if native_bor else [mask]
    sizes = [32] * 4 if padded else [8 * (q + 1) for q in range(4)]
    gather_wire = 180 + 180 + sum(sizes) - sizes[(rank + 1) % 4]
    bcast_wire = 0 if rank == 1 else 100 * F32          # chain 2→3→0→1
    exp["world"] = {
        "allreduce": (2, 7 * I64 + 5 * F32, 2 * 3 * (7 * I64 + 5 * F32) // 4,      # sum, then max
                      2 * 3 * (7 * I64 + 5 * F32) // 4 if crosses else 0),
        "bor": (len(bor_bytes), sum(bor_bytes), sum(2 * 3 * b // 4 for b in bor_bytes),
                sum(2 * 3 * b // 4 for b in bor_bytes) if crosses else 0),
        "broadcast": (1, 100 * F32, bcast_wire, bcast_wire if rank == 3 else 0),
        "allgather_sizes": (2, 2 * SIZES_MSG, 2 * 3 * SIZES_MSG, 2 * 3 * SIZES_MSG if crosses else 0),
        "allgather": (3, 60 + 60 + sizes[rank], gather_wire, gather_wire if crosses else 0),
        "barrier": (1, 0, 0, 0),
    }
    return exp


def check_results(results, backends, accounted_as=None):
    for res in results:
        topo = res["topology"]
        rank = topo["rank"]
        assert (topo["size"], topo["num_nodes"], topo["local_size"]) == (4, 2, 2)
        assert topo["node"] == rank // 2 and topo["local_rank"] == rank % 2
        assert topo["is_leader"] == (rank % 2 == 0) and topo["node_ranks"] == [[0, 1], [2, 3]]
        for backend in backends:
            summary = res["backends"][backend]
            exp = expected_ledger(rank, (accounted_as or {}).get(backend, backend))
            for tier in ("intra", "inter", "world"):
                got = {op: (v["ops"], v["payload_bytes"], v["wire_bytes"], v["cross_node_bytes"])
                       for op, v in summary[tier].get("by_op", {}).items()}
                assert got == exp.get(tier, {}), f"rank {rank} {backend} {tier}"
            inter_cross = sum(v[3] for v in exp.get("inter", {}).values())
            assert summary["inter"]["cross_node_bytes"] == inter_cross
            assert summary["intra"]["cross_node_bytes"] == 0


def results(proc, out, case=None):
    return worker_results(proc, out, "comm", case=case)


OVERRIDE = register("mpirun-2x2", "collectives", "comm_worker", "--backends", "mpi,gloo,auto")
RING = register("mpirun-2x2", "async-ring", "ring_worker")
HOROVOD_UNDER_MPIRUN = register("mpirun-2x2", "collectives-horovod", "comm_worker", "--backends", "horovod",
                                "--ranks-per-node", "2")


@needs_mpirun
def test_mpirun_override(shared_launch):
    """mpirun puts all 4 ranks on one host: PRUNEX_RANKS_PER_NODE=2 makes them 2 emulated nodes."""
    check_results(results(*shared_launch("mpirun-2x2"), OVERRIDE), ["mpi", "gloo", "auto"],
                  accounted_as={"auto": "mpi"})


@needs_mpirun
@needs_horovod
def test_mpirun_horovod_backend(shared_launch):
    check_results(results(*shared_launch("mpirun-2x2"), HOROVOD_UNDER_MPIRUN), ["horovod"])


HOROVODRUN = register("horovodrun-2x2", "collectives", "comm_worker", "--backends", "gloo,horovod,auto")


@needs_horovod
def test_horovodrun_gloo_two_hosts(shared_launch):
    """horovodrun --gloo with two host names for one machine: Horovod itself reports 2 nodes × 2."""
    ranks = results(*shared_launch("horovodrun-2x2"), HOROVODRUN)
    check_results(ranks, ["gloo", "horovod", "auto"], accounted_as={"auto": "gloo"})
    grouping = ranks[0]["topology"]["grouping"]
    assert grouping == "horovod-cross-rank"


@needs_mpirun
@needs_horovod
def test_horovodrun_mpi(tmp_path):
    proc = run(horovodrun(4, "localhost:4", python_cmd("comm_worker.py", "--backends", "mpi,horovod",
                                                       "--ranks-per-node", "2", "--out", str(tmp_path)),
                          controller="mpi"))
    check_results(results(proc, tmp_path), ["mpi", "horovod"])


def test_torchrun(tmp_path):
    proc = run(torchrun(4, python_cmd("comm_worker.py", "--backends", "gloo", "--out", str(tmp_path))),
               env={"PRUNEX_RANKS_PER_NODE": "2"})
    check_results(results(proc, tmp_path), ["gloo"])


@needs_mpirun
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for NCCL")
def test_nccl(tmp_path):
    n = torch.cuda.device_count()
    if n >= 4:
        proc = run(mpirun(4, python_cmd("comm_worker.py", "--backends", "nccl,auto", "--device", "cuda",
                                        "--ranks-per-node", "2", "--out", str(tmp_path))))
        check_results(results(proc, tmp_path), ["nccl", "auto"], accounted_as={"auto": "nccl"})
    else:
        # one GPU: NCCL refuses two ranks on one device, so run the nccl groups with one rank for real
        proc = run(mpirun(1, python_cmd("comm_worker.py", "--backends", "nccl", "--device", "cuda")))
        assert proc.returncode == 0 and "] ok rank" in proc.stdout, proc.stdout[-6000:]


RACK_CASES = {"mpi": register("mpirun-racks", "rack-groups-mpi", "rack_worker", "--backend", "mpi"),
              "gloo": register("mpirun-racks", "rack-groups-gloo", "rack_worker", "--backend", "gloo"),
              "horovod": register("horovodrun-racks", "rack-groups-horovod", "rack_worker", "--backend", "horovod")}


def check_rack_results(launched, backend):
    """Every rank's rack and spine groups, and the bytes that crossed racks: only the spine's allreduce and the
    world ring's two hops between racks (ranks 3 and 7) leave a rack."""
    proc, out = launched
    results = worker_results(proc, out, "rack", ranks=8, case=RACK_CASES[backend])
    nbytes = 4000
    for r, res in enumerate(results):
        assert res["members"].get("rack") == {0: [0, 2], 2: [0, 2], 4: [4, 6], 6: [4, 6]}.get(r)
        assert res["members"].get("spine") == ([0, 4] if r in (0, 4) else None)
        rack_bytes = {tier: res["ledger"][tier]["cross_rack_bytes"] for tier in ("rack", "spine", "world")}
        world = 2 * 7 * nbytes // 8
        assert rack_bytes == {"rack": 0, "spine": nbytes if r in (0, 4) else 0,
                              "world": world if r in (3, 7) else 0}, (r, rack_bytes)


@needs_mpirun
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_rack_groups_under_mpirun(shared_launch, backend):
    check_rack_results(shared_launch("mpirun-racks"), backend)


@needs_horovod
def test_rack_groups_under_horovodrun(shared_launch):
    check_rack_results(shared_launch("horovodrun-racks"), "horovod")


@needs_mpirun
def test_mpi_async_allreduce_is_a_polled_ring(shared_launch):
    """MPI's async allreduce (the overlapped round's exchange) runs as a ring of polled sends and receives:
    on 4, 2 and 2 members, every dtype and op, lengths from 0 up, it gives every member the same result, the
    blocking allreduce's bits where one order of adds is all there is, and two in flight at once while another
    group runs blocking collectives."""
    proc, out = shared_launch("mpirun-2x2")
    assert [r["checks"] for r in worker_results(proc, out, "ring", case=RING)] == [198, 132, 198, 132]
