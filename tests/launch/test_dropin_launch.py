"""Existing training scripts under their own launchers (4 ranks as 2 nodes × 2): mixed precision with an inf on
one rank, hvd.init() and px.init() in every order, and the converted Horovod and torchrun/DDP examples."""
import re
import sys
from pathlib import Path

import pytest

from engine_cases import CHANNEL, LOCAL_STEPS, ROUNDS, check_results
from launching import BIN, horovodrun, mpirun, needs_horovod, needs_mpirun, python_cmd, run, torchrun, worker_results

pytestmark = pytest.mark.launch
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HOSTS = "localhost:2,127.0.0.1:2"
SCALE = 65536.0   # GradScaler's initial scale; an inf halves it on the scaler that saw it


@needs_mpirun
@pytest.mark.parametrize("flags, skipped, halved", [
    ([], {1: {4}, 2: {7}}, {1: 1, 2: 1}),
    # node_sync: the inf reaches the node's mean, so its node skips together; only rank 1's scaler saw it
    (["--node-sync"], {0: {4}, 1: {4}, 2: {7}, 3: {7}}, {1: 1, 2: 1}),
    # Horovod's pattern: synchronize() averages first, so both scalers of the node see the inf
    (["--node-sync", "--amp-pattern", "horovod"], {0: {4}, 1: {4}, 2: {7}, 3: {7}}, dict.fromkeys(range(4), 1)),
    # unscale_ before synchronize(): each scaler judged its own gradients, the node's mean still decides
    (["--node-sync", "--amp-pattern", "unscale-first"], {0: {4}, 1: {4}, 2: {7}, 3: {7}}, {1: 1, 2: 1}),
], ids=["scaler.step", "node-sync", "node-sync-horovod-pattern", "node-sync-unscale-first"])
def test_amp_inf_on_one_rank_skips_its_step_and_the_rounds_stay_aligned(tmp_path, flags, skipped, halved):
    """CPU autocast (bf16) with a GradScaler; rank 1 finds an inf at step 4 and rank 2 at step 7. Each skips that
    step but counts it, so every round lines up; the worker checks every round against the reference.
    ``halved``: how often each rank's scaler halved its scale."""
    proc = run(mpirun(4, python_cmd("engine_worker.py", "--backend", "mpi", "--amp-inf", "1:4,2:7", *flags,
                                    "--out", str(tmp_path)), ["PRUNEX_RANKS_PER_NODE=2"]))
    results = worker_results(proc, tmp_path, "engine")
    check_results(results, CHANNEL)
    for r in results:
        assert r["moved"] == [j not in skipped.get(r["rank"], ()) for j in range(ROUNDS * LOCAL_STEPS)], r["rank"]
        assert r["scale"] == SCALE / 2 ** halved.get(r["rank"], 0), r["rank"]


@needs_horovod
@pytest.mark.parametrize("order", ["hvd-then-px", "px-then-hvd", "hvd-only", "neither",
                                   "hvd-dynamic-then-px-horovod", "px-horovod-then-hvd"])
def test_hvd_init_and_px_init_in_any_order(tmp_path, order):
    proc = run(horovodrun(4, HOSTS, python_cmd("hvd_order_worker.py", "--order", order, "--out", str(tmp_path))),
               timeout=240)
    results = worker_results(proc, tmp_path, "hvd-order")
    assert {(r["size"], r["nodes"], r["steps"], r["rounds"]) for r in results} == {(4, 2, 4, 2)}
    assert len({r["digest"] for r in results}) == 1   # finalize(): one model everywhere


@needs_horovod
@pytest.mark.parametrize("order", ["hvd-then-px-horovod", "hvd-only-wrap-horovod"])
def test_the_horovod_backend_after_a_plain_hvd_init_says_what_to_do(tmp_path, order):
    proc = run(horovodrun(4, HOSTS, python_cmd("hvd_order_worker.py", "--order", order, "--out", str(tmp_path))),
               timeout=240)
    assert proc.returncode != 0
    said = re.findall(r"hvd-order worker error: .*without dynamic process sets: call prunex_hvd.init\(\) before "
                      r"hvd.init\(\), or hvd.init\(process_sets='dynamic'\)", proc.stdout)
    assert len(said) == 4, proc.stdout[-4000:]


@needs_horovod
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_horovod_example_runs_an_epoch(amp):
    cmd = [sys.executable, str(EXAMPLES / "horovod_mnist.py"), "--epochs", "2"] \
        + (["--use-mixed-precision"] * amp)
    proc = run(horovodrun(4, HOSTS, cmd), timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    accuracy = [float(a) for a in re.findall(r"Test set: Average loss: [\d.]+, Accuracy: ([\d.]+)%", proc.stdout)]
    assert len(accuracy) == 2 and accuracy[-1] > 40, proc.stdout[-2000:]   # 10 classes: well above chance
    assert re.search(r"PruneX: density 0\.\d+, 2 rounds, [\d.]+ MiB across nodes", proc.stdout), proc.stdout[-2000:]


def test_torchrun_ddp_example_runs_an_epoch(tmp_path):
    cmd = [sys.executable, str(EXAMPLES / "torchrun_ddp.py"), "--epochs", "1", "--amp", "--compile",
           "--compile-backend", "aot_eager", "--save", str(tmp_path / "model.pt")]
    proc = run(torchrun(4, cmd), env={"PRUNEX_RANKS_PER_NODE": "2"}, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert re.search(r"epoch 1: loss [\d.]+, test accuracy 0\.\d+", proc.stdout), proc.stdout[-2000:]
    assert re.search(r"PruneX: density 0\.\d+, 1 rounds, [\d.]+ MiB across nodes", proc.stdout)
    import torch
    state = torch.load(tmp_path / "model.pt")
    assert not any(k.startswith("_orig_mod") for k in state)
