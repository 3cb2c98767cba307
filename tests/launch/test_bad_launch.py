"""A bad launch fails fast, with the message on every rank, and never hangs (every launch has a timeout).

Cases that need no launch of their own share one: each ``init`` error of a plain mpirun launch is tried in
turn in the ``init_errors`` job, each construction error in the ``construction_errors`` job (an error raised on
every rank leaves them all in step for the next case); a test per case reads its case's files."""
import re

import pytest

from launching import horovodrun, mpirun, needs_horovod, needs_mpirun, python_cmd, run

pytestmark = pytest.mark.launch


def assert_every_rank_says(proc, out, pattern, n=4, failed=True):
    """Every rank raised the error (each worker writes what it caught to out/error.rank{R}.txt)."""
    assert (proc.returncode != 0) == failed, proc.stdout[-4000:]
    said = {}
    for path in out.glob("error.rank*.txt"):
        m = re.fullmatch(r"\[rank (\d+)\] prunex_hvd error: (.*)", path.read_text(), re.S)
        if m and re.search(pattern, m.group(2)):
            said[int(m.group(1))] = m.group(2)
    assert set(said) == set(range(n)), f"ranks that reported /{pattern}/: {sorted(said)}\n{proc.stdout[-4000:]}"


def worker(out, *args):
    return python_cmd("comm_worker.py", "--out", str(out), *args)


def mpmd_override(out, first: str, second: str) -> list:
    """Ranks 0-1 and ranks 2-3 launched with different PRUNEX_RANKS_PER_NODE (an MPMD launch)."""
    return (mpirun(2, worker(out), [f"PRUNEX_RANKS_PER_NODE={first}"]) + [":"]
            + ["-np", "2", "-x", f"PRUNEX_RANKS_PER_NODE={second}"] + worker(out))


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def init_errors(tmp_path_factory):
    """One mpirun job (PRUNEX_RANKS_PER_NODE=3 from the launcher) trying, in turn, the ``init`` calls that must
    fail on every rank (comm_worker.py ``--try-init``), then a good ``init`` (2 nodes × 2) whose collectives
    must work: (the job, its out folder)."""
    out = tmp_path_factory.mktemp("init_errors")
    tries = ["env", "bogus"] + ([] if cuda_available() else ["nccl"])
    proc = run(mpirun(4, worker(out, "--try-init", ",".join(tries), "--ranks-per-node", "2", "--backends", "mpi"),
                      ["PRUNEX_RANKS_PER_NODE=3"]), timeout=180)
    return proc, out


@needs_horovod
def test_heterogeneous_hosts_horovodrun(tmp_path):
    proc = run(horovodrun(4, "localhost:3,127.0.0.1:1", worker(tmp_path)), timeout=120)
    assert_every_rank_says(proc, tmp_path, r"heterogeneous nodes: .*node 0: 3 ranks \(0,1,2\); node 1: 1 rank \(3\)")


@needs_mpirun
def test_override_that_does_not_divide(init_errors):
    proc, out = init_errors
    assert_every_rank_says(proc, out / "env", r"ranks_per_node=3 does not divide the world size 4", failed=False)


@needs_mpirun
def test_ranks_disagree_about_override(tmp_path):
    proc = run(mpmd_override(tmp_path, "2", "1"), timeout=120)
    assert_every_rank_says(proc, tmp_path, r"ranks disagree about ranks_per_node .*2 on ranks 0,1; 1 on ranks 2,3")


@needs_mpirun
def test_override_garbage_on_some_ranks(tmp_path):
    proc = run(mpmd_override(tmp_path, "abc", "2"), timeout=120)
    assert_every_rank_says(proc, tmp_path, r"ranks_per_node must be a positive integer, got 'abc' \[on rank\(s\) 0,1\]")


@needs_mpirun
def test_bogus_backend_name(init_errors):
    proc, out = init_errors
    assert_every_rank_says(proc, out / "bogus", r"unknown backend 'bogus': choose one of auto, mpi, gloo, nccl, horovod",
                           failed=False)


@needs_horovod
def test_mpi_backend_under_horovodrun_gloo(tmp_path):
    proc = run(horovodrun(4, "localhost:2,127.0.0.1:2", worker(tmp_path, "--init-backend", "mpi")),
               timeout=120)
    assert_every_rank_says(proc, tmp_path, r"mpi backend needs a launch by mpirun.*horovodrun --gloo.*\[on all ranks\]")


@needs_mpirun
@pytest.mark.skipif(cuda_available(), reason="this host has CUDA")
def test_nccl_without_cuda(init_errors):
    proc, out = init_errors
    assert_every_rank_says(proc, out / "nccl", r"nccl backend needs CUDA.*\[on all ranks\]", failed=False)


@needs_mpirun
def test_a_good_init_after_the_failed_ones(init_errors):
    """The failed ``init`` calls left nothing behind: the next one builds 2 nodes × 2 and its collectives work."""
    import json
    proc, out = init_errors
    assert proc.returncode == 0 and proc.stdout.count("] ok ") == 4, proc.stdout[-4000:]
    for r in range(4):
        topo = json.loads((out / f"rank{r}.json").read_text())["topology"]
        assert (topo["rank"], topo["node"], topo["num_nodes"]) == (r, r // 2, 2), topo


DISAGREE = {
    "model": r"ranks disagree on prunex_hvd.DistributedOptimizer: model differs from rank 0's on rank\(s\) 2 "
             r"\(first difference: rank 0 has 0.weight \(8, 3, 3, 3\) torch.float32, rank 2 has 0.weight \(10, 3, 3, 3\)",
    "spec": r"sparsity differs from rank 0's on rank\(s\) 2",
    "keep": r"keep ratio must be in \(0, 1\] \[on rank\(s\) 2\]",
    "rho": r"rho differs from rank 0's on rank\(s\) 2",
}
BASELINES = {"dense": "dense", "topk": "Top-K", "pactrain": "PacTrain"}
LOCAL_INPUT = {"glob": r"sparsity glob 'nope\.\*' matches no parameter",
               "nonconv": r"'1\.weight' \(shape \(8,\)\) is not a conv weight",
               "rho0": r"rho1 must be a finite number > 0, got 0\.0",
               "steps0": r"local_steps must be an integer >= 1, got 0",
               "rival-localsgd": r"period must be an integer >= 1, got 0",
               "rival-localsgd-hier": r"intra_period 3 must divide period 4",
               "rival-diloco": r"outer_lr must be a number > 0, got 0\.0"}


@pytest.fixture(scope="module")
def construction_errors(tmp_path_factory):
    """One mpirun job (2 nodes × 2) trying every case below in turn (agree_worker.py ``--cases``), then a
    construction alike on every rank, which must work: (the job, its out folder)."""
    out = tmp_path_factory.mktemp("construction_errors")
    cases = [*DISAGREE, *(f"model-{m}" for m in BASELINES), *LOCAL_INPUT]
    proc = run(mpirun(4, python_cmd("agree_worker.py", "--cases", ",".join(cases), "--out", str(out)),
                      ["PRUNEX_RANKS_PER_NODE=2"]), timeout=240)
    return proc, out


@needs_mpirun
@pytest.mark.parametrize("case", DISAGREE)
def test_ranks_that_disagree_at_construction(construction_errors, case):
    """Rank 2 wraps another model, spec, an invalid keep ratio or another rho: all four ranks refuse, none
    goes on into the broadcast alone."""
    proc, out = construction_errors
    assert_every_rank_says(proc, out / case, DISAGREE[case], failed=False)


@needs_mpirun
@pytest.mark.parametrize("method", BASELINES)
def test_baselines_refuse_a_different_model_on_one_rank(construction_errors, method):
    proc, out = construction_errors
    assert_every_rank_says(proc, out / f"model-{method}",
                           rf"ranks disagree on the {BASELINES[method]} optimizer: model differs from rank 0's "
                           r"on rank\(s\) 2", failed=False)


@needs_mpirun
@pytest.mark.parametrize("case", LOCAL_INPUT)
def test_local_input_errors_on_one_rank_are_raised_on_every_rank(construction_errors, case):
    """Rank 2 alone names a parameter that does not exist, puts structure on a BatchNorm weight, passes rho1=0 or
    local_steps=0, or gives a round-based rival a bad period, node period or outer lr: every rank raises that
    error with rank 2 named."""
    proc, out = construction_errors
    assert_every_rank_says(proc, out / case, LOCAL_INPUT[case] + r".* \[on rank\(s\) 2\]", failed=False)


@needs_mpirun
def test_every_rank_constructs_after_the_refusals(construction_errors):
    """The refused constructions left every rank in step: the same model and spec on all of them still works."""
    import json
    proc, out = construction_errors
    assert proc.returncode == 0 and proc.stdout.count("] ok checks=") == 4, proc.stdout[-4000:]
    assert all(json.loads((out / f"rank{r}.json").read_text())["constructed_after"] for r in range(4))
