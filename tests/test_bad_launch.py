"""A bad launch fails fast, with the message on every rank, and never hangs (every launch has a timeout)."""
import re

import pytest

from launching import horovodrun, mpirun, needs_horovod, needs_mpirun, python_cmd, run

pytestmark = pytest.mark.launch


def assert_every_rank_says(proc, pattern, n=4):
    assert proc.returncode != 0, proc.stdout[-4000:]
    said = {int(m.group(1)) for m in re.finditer(r"\[rank (\d+)\] prunex_hvd error: (.*)", proc.stdout)
            if re.search(pattern, m.group(2))}
    assert said == set(range(n)), f"ranks that reported /{pattern}/: {sorted(said)}\n{proc.stdout[-4000:]}"


def mpmd_override(first: str, second: str) -> list:
    """Ranks 0-1 and ranks 2-3 launched with different PRUNEX_RANKS_PER_NODE (an MPMD launch)."""
    return (mpirun(2, python_cmd("comm_worker.py"), [f"PRUNEX_RANKS_PER_NODE={first}"]) + [":"]
            + ["-np", "2", "-x", f"PRUNEX_RANKS_PER_NODE={second}"] + python_cmd("comm_worker.py"))


@needs_horovod
def test_heterogeneous_hosts_horovodrun():
    proc = run(horovodrun(4, "localhost:3,127.0.0.1:1", python_cmd("comm_worker.py")), timeout=120)
    assert_every_rank_says(proc, r"heterogeneous nodes: .*node 0: 3 ranks \(0,1,2\); node 1: 1 rank \(3\)")


@needs_mpirun
def test_override_that_does_not_divide():
    proc = run(mpirun(4, python_cmd("comm_worker.py"), ["PRUNEX_RANKS_PER_NODE=3"]), timeout=120)
    assert_every_rank_says(proc, r"ranks_per_node=3 does not divide the world size 4")


@needs_mpirun
def test_ranks_disagree_about_override():
    proc = run(mpmd_override("2", "1"), timeout=120)
    assert_every_rank_says(proc, r"ranks disagree about ranks_per_node .*2 on ranks 0,1; 1 on ranks 2,3")


@needs_mpirun
def test_override_garbage_on_some_ranks():
    proc = run(mpmd_override("abc", "2"), timeout=120)
    assert_every_rank_says(proc, r"ranks_per_node must be a positive integer, got 'abc' \[on rank\(s\) 0,1\]")


@needs_mpirun
def test_bogus_backend_name():
    proc = run(mpirun(4, python_cmd("comm_worker.py", "--init-backend", "bogus")), timeout=120)
    assert_every_rank_says(proc, r"unknown backend 'bogus': choose one of auto, mpi, gloo, nccl, horovod")


@needs_horovod
def test_mpi_backend_under_horovodrun_gloo():
    proc = run(horovodrun(4, "localhost:2,127.0.0.1:2", python_cmd("comm_worker.py", "--init-backend", "mpi")),
               timeout=120)
    assert_every_rank_says(proc, r"mpi backend needs a launch by mpirun.*horovodrun --gloo.*\[on all ranks\]")


@needs_mpirun
def test_nccl_without_cuda():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    proc = run(mpirun(4, python_cmd("comm_worker.py", "--init-backend", "nccl"), ["PRUNEX_RANKS_PER_NODE=2"]),
               timeout=120)
    assert_every_rank_says(proc, r"nccl backend needs CUDA.*\[on all ranks\]")
