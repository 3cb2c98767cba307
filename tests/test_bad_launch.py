"""A bad launch fails fast, with the message on every rank, and never hangs (every launch has a timeout)."""
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


@needs_horovod
def test_heterogeneous_hosts_horovodrun(tmp_path):
    proc = run(horovodrun(4, "localhost:3,127.0.0.1:1", worker(tmp_path)), timeout=120)
    assert_every_rank_says(proc, tmp_path, r"heterogeneous nodes: .*node 0: 3 ranks \(0,1,2\); node 1: 1 rank \(3\)")


@needs_mpirun
def test_override_that_does_not_divide(tmp_path):
    proc = run(mpirun(4, worker(tmp_path), ["PRUNEX_RANKS_PER_NODE=3"]), timeout=120)
    assert_every_rank_says(proc, tmp_path, r"ranks_per_node=3 does not divide the world size 4")


@needs_mpirun
def test_ranks_disagree_about_override(tmp_path):
    proc = run(mpmd_override(tmp_path, "2", "1"), timeout=120)
    assert_every_rank_says(proc, tmp_path, r"ranks disagree about ranks_per_node .*2 on ranks 0,1; 1 on ranks 2,3")


@needs_mpirun
def test_override_garbage_on_some_ranks(tmp_path):
    proc = run(mpmd_override(tmp_path, "abc", "2"), timeout=120)
    assert_every_rank_says(proc, tmp_path, r"ranks_per_node must be a positive integer, got 'abc' \[on rank\(s\) 0,1\]")


@needs_mpirun
def test_bogus_backend_name(tmp_path):
    proc = run(mpirun(4, worker(tmp_path, "--init-backend", "bogus")), timeout=120)
    assert_every_rank_says(proc, tmp_path, r"unknown backend 'bogus': choose one of auto, mpi, gloo, nccl, horovod")


@needs_horovod
def test_mpi_backend_under_horovodrun_gloo(tmp_path):
    proc = run(horovodrun(4, "localhost:2,127.0.0.1:2", worker(tmp_path, "--init-backend", "mpi")),
               timeout=120)
    assert_every_rank_says(proc, tmp_path, r"mpi backend needs a launch by mpirun.*horovodrun --gloo.*\[on all ranks\]")


@needs_mpirun
def test_nccl_without_cuda(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    proc = run(mpirun(4, worker(tmp_path, "--init-backend", "nccl"), ["PRUNEX_RANKS_PER_NODE=2"]),
               timeout=120)
    assert_every_rank_says(proc, tmp_path, r"nccl backend needs CUDA.*\[on all ranks\]")


@needs_mpirun
@pytest.mark.parametrize("case,pattern", [
    ("model", r"ranks disagree on prunex_hvd.DistributedOptimizer: model differs from rank 0's on rank\(s\) 2 "
              r"\(first difference: rank 0 has 0.weight \(8, 3, 3, 3\) torch.float32, rank 2 has 0.weight \(10, 3, 3, 3\)"),
    ("spec", r"sparsity differs from rank 0's on rank\(s\) 2"),
    ("keep", r"keep ratio must be in \(0, 1\] \[on rank\(s\) 2\]"),
    ("rho", r"rho differs from rank 0's on rank\(s\) 2"),
])
def test_ranks_that_disagree_at_construction(tmp_path, case, pattern):
    """Rank 2 wraps another model, spec, an invalid keep ratio or another rho: all four ranks refuse, none
    goes on into the broadcast alone."""
    proc = run(mpirun(4, python_cmd("agree_worker.py", "--case", case, "--out", str(tmp_path)),
                      ["PRUNEX_RANKS_PER_NODE=2"]), timeout=120)
    assert_every_rank_says(proc, tmp_path, pattern)


@needs_mpirun
@pytest.mark.parametrize("method,name", [("dense", "dense"), ("topk", "Top-K"), ("pactrain", "PacTrain")])
def test_baselines_refuse_a_different_model_on_one_rank(tmp_path, method, name):
    proc = run(mpirun(4, python_cmd("agree_worker.py", "--case", "model", "--method", method, "--out", str(tmp_path)),
                      ["PRUNEX_RANKS_PER_NODE=2"]), timeout=120)
    assert_every_rank_says(proc, tmp_path, rf"ranks disagree on the {name} optimizer: model differs from rank 0's "
                                           r"on rank\(s\) 2")


@needs_mpirun
def test_local_input_errors_on_one_rank_are_raised_on_every_rank(tmp_path):
    """Rank 2 alone names a parameter that does not exist, puts structure on a BatchNorm weight, passes rho1=0 or
    local_steps=0: every rank raises that error with rank 2 named (four cases in one job, in step)."""
    cases = {"glob": r"sparsity glob 'nope\.\*' matches no parameter",
             "nonconv": r"'1\.weight' \(shape \(8,\)\) is not a conv weight",
             "rho0": r"rho1 must be a finite number > 0, got 0\.0",
             "steps0": r"local_steps must be an integer >= 1, got 0"}
    proc = run(mpirun(4, python_cmd("agree_worker.py", "--cases", ",".join(cases), "--out", str(tmp_path)),
                      ["PRUNEX_RANKS_PER_NODE=2"]), timeout=120)
    for case, pattern in cases.items():
        assert_every_rank_says(proc, tmp_path / case, pattern + r".* \[on rank\(s\) 2\]", failed=False)
