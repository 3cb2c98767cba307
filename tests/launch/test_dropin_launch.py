"""Existing training scripts under their own launchers (4 ranks as 2 nodes × 2): hvd.init() and px.init() in
every order, and the converted Horovod and torchrun/DDP examples. (Mixed precision with an inf on one rank:
test_engine_launch.py, every round against the reference.)"""
import re
import sys
from pathlib import Path

import pytest

from launching import horovodrun, needs_horovod, needs_mpirun, python_cmd, run, torchrun, worker_results
from shared_launches import register

pytestmark = pytest.mark.launch
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HOSTS = "localhost:2,127.0.0.1:2"


# the orders PruneX refuses, each tried first in the launch of an order that works after it
REFUSED_FIRST = {"hvd-then-px": "hvd-then-px-horovod", "hvd-only": "hvd-only-wrap-horovod"}


def order_job(out, order):
    first = ["--refused-first", REFUSED_FIRST[order]] if order in REFUSED_FIRST else []
    return run(horovodrun(4, HOSTS, python_cmd("hvd_order_worker.py", "--order", order, *first, "--out", str(out))),
               timeout=240), out


def launched_order(item):
    """The order whose job ``item`` (a test of this module taking ``order_jobs``) reads, else None."""
    if "order_jobs" not in getattr(item, "fixturenames", ()) or not hasattr(item, "callspec"):
        return None
    order = item.callspec.params["order"]
    return {refused: then for then, refused in REFUSED_FIRST.items()}.get(order, order)


@pytest.fixture(scope="module")
def order_jobs(request, tmp_path_factory):
    """order -> (its horovodrun job, its out folder). On first use, the jobs of every order the session's tests
    read start, two at a time, in the tests' order: each job is a launch of its own (a fresh hvd.init), and
    much of a launch is horovodrun's start-up and teardown, which two launches overlap."""
    from concurrent.futures import ThreadPoolExecutor
    wanted = list(dict.fromkeys(filter(None, map(launched_order, request.session.items))))
    with ThreadPoolExecutor(2) as pool:
        jobs = {order: pool.submit(order_job, tmp_path_factory.mktemp(order), order) for order in wanted}

        def job(order):
            if order not in jobs:
                jobs[order] = pool.submit(order_job, tmp_path_factory.mktemp(order), order)
            return jobs[order].result()
        yield job


@needs_horovod
@pytest.mark.parametrize("order", ["hvd-then-px", "px-then-hvd", "hvd-only", "neither",
                                   "hvd-dynamic-then-px-horovod", "px-horovod-then-hvd"])
def test_hvd_init_and_px_init_in_any_order(order_jobs, order):
    proc, out = order_jobs(order)
    results = worker_results(proc, out, "hvd-order")
    assert {(r["size"], r["nodes"], r["steps"], r["rounds"]) for r in results} == {(4, 2, 4, 2)}
    assert len({r["digest"] for r in results}) == 1   # finalize(): one model everywhere


@needs_horovod
@pytest.mark.parametrize("order", ["hvd-then-px-horovod", "hvd-only-wrap-horovod"])
def test_the_horovod_backend_after_a_plain_hvd_init_says_what_to_do(order_jobs, order):
    proc, _ = order_jobs({refused: then for then, refused in REFUSED_FIRST.items()}[order])
    said = re.findall(r"\] refused: .*without dynamic process sets: call prunex_hvd.init\(\) before "
                      r"hvd.init\(\), or hvd.init\(process_sets='dynamic'\)", proc.stdout)
    assert len(said) == 4, proc.stdout[-4000:]


@needs_horovod
def test_horovod_example_runs_an_epoch():
    """Horovod's MNIST example as converted, with its mixed precision (Horovod's AMP pattern around the step)."""
    cmd = [sys.executable, str(EXAMPLES / "horovod_mnist.py"), "--epochs", "2", "--use-mixed-precision"]
    proc = run(horovodrun(4, HOSTS, cmd), timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    accuracy = [float(a) for a in re.findall(r"Test set: Average loss: [\d.]+, Accuracy: ([\d.]+)%", proc.stdout)]
    assert len(accuracy) == 2 and accuracy[-1] > 40, proc.stdout[-2000:]   # 10 classes: well above chance
    assert re.search(r"PruneX: density 0\.\d+, 2 rounds, [\d.]+ MiB across nodes", proc.stdout), proc.stdout[-2000:]


def test_torchrun_ddp_example_runs_an_epoch(tmp_path):
    # eager: dynamo traces the wrapped model on every rank (aot_eager's autograd tracing, slow on 4 ranks of 2
    # cores, runs in one process in tests/api/test_dropin.py)
    cmd = [sys.executable, str(EXAMPLES / "torchrun_ddp.py"), "--epochs", "1", "--amp", "--compile",
           "--compile-backend", "eager", "--save", str(tmp_path / "model.pt")]
    proc = run(torchrun(4, cmd), env={"PRUNEX_RANKS_PER_NODE": "2"}, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert re.search(r"epoch 1: loss [\d.]+, test accuracy 0\.\d+", proc.stdout), proc.stdout[-2000:]
    assert re.search(r"PruneX: density 0\.\d+, 1 rounds, [\d.]+ MiB across nodes", proc.stdout)
    import torch
    state = torch.load(tmp_path / "model.pt")
    assert not any(k.startswith("_orig_mod") for k in state)


RESUME = register("mpirun-2x2", "resume-own-state", "resume_worker", "--backend", "mpi")


def check_resume(proc, out, case=None):
    """Rank 0's state loaded everywhere: refused on every rank, saying what to do; each rank's own: taken (the
    worker checks it equals what was saved), and the job trained on to its second round."""
    results = worker_results(proc, out, "resume", case=case)
    assert [r["rounds"] for r in results] == [2] * 4
    folder = out / case if case else out
    for r in range(4):
        text = (folder / f"error.rank{r}.txt").read_text()
        assert "this optimizer state is rank 0's, loaded on rank" in text, text
        assert "save the state on every rank and load each rank's own file" in text, text


@needs_mpirun
def test_a_state_saved_on_rank_0_is_refused_everywhere_and_each_rank_s_own_loads_under_mpirun(shared_launch):
    check_resume(*shared_launch("mpirun-2x2"), RESUME)


HOROVODRUN_RESUME = register("horovodrun-2x2", "resume-own-state", "resume_worker")


@needs_horovod
def test_a_state_saved_on_rank_0_is_refused_everywhere_and_each_rank_s_own_loads_under_horovodrun(shared_launch):
    check_resume(*shared_launch("horovodrun-2x2"), HOROVODRUN_RESUME)
