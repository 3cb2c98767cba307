"""The round-based rivals on real launches (2 nodes × 2): local SGD, hierarchical local SGD and DiLoCo, every
step against the single-process reference in tests/workers/averaging_worker.py, and their bytes exact under
the ring model (world ring 0→1→2→3→0: ranks 1 and 3 send across nodes; a node's ring stays inside it)."""
import pytest

from launching import needs_mpirun, worker_results
from shared_launches import register

pytestmark = pytest.mark.launch

METHODS = ("localsgd", "localsgd-hier", "diloco")
STEPS, PERIOD, INTRA = 10, 4, 2
WORLD_ROUNDS = STEPS // PERIOD + 1                                 # after steps 4 and 8, and the short one
NODE_ROUNDS = sum(1 for s in range(1, STEPS + 1) if s % INTRA == 0 and s % PERIOD)   # steps 2, 6, 10


def ring_sent(nbytes, n):
    return 2 * (n - 1) * nbytes // n


def check_bytes(results):
    numels = results[0]["numels"]
    params, buffers = 4 * numels["params"], 4 * numels["buffers"]
    for method in METHODS:
        per_rank = [r[method]["stats"] for r in results]
        assert all(s["rounds"] == WORLD_ROUNDS and s["steps"] == STEPS for s in per_rank), (method, per_rank)
        # a world round: parameters (PyTorch's one flat allreduce) and buffers (ours), each ring 2(n-1)/n·B;
        # only ranks 1 and 3 send across nodes
        world_round = ring_sent(params, 4) + ring_sent(buffers, 4)
        for r, s in enumerate(per_rank):
            cross = world_round * WORLD_ROUNDS if r in (1, 3) else 0
            node = ring_sent(params, 2) * NODE_ROUNDS if method == "localsgd-hier" else 0
            assert s["inter_bytes"] == cross, (method, r, s["inter_bytes"], cross)
            assert s["intra_bytes"] == world_round * WORLD_ROUNDS - cross + node, (method, r, s["intra_bytes"])
        ledger = results[1][method]["ledger"]
        assert ledger["world"]["cross_node_bytes"] == world_round * WORLD_ROUNDS
        if method == "localsgd-hier":
            assert ledger["intra"]["cross_node_bytes"] == 0 and ledger["intra"]["ops"] == NODE_ROUNDS


CASE = {backend: register("mpirun-2x2", f"rivals-{backend}", "averaging_worker", "--backend", backend,
                          "--methods", ",".join(METHODS)) for backend in ("mpi", "gloo")}


@needs_mpirun
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_rivals_match_the_reference_under_mpirun(shared_launch, backend):
    """Over MPI's and over torch.distributed's Gloo groups (what ``auto`` picks under horovodrun)."""
    proc, out = shared_launch("mpirun-2x2")
    check_bytes(worker_results(proc, out, "averaging", case=CASE[backend]))
