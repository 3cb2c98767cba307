"""Every --method in one harness on 4 ranks as 2 nodes × 2 (`prunex-hvd compare` under mpirun): each trains
the small model on digits to a sensible accuracy, and the job's inter-node bytes match the method's formula
exactly under the ring model (world ring 0→1→2→3→0: ranks 1 and 3 send across nodes)."""
import json

import pytest

from launching import BIN, have_horovod, mpirun, needs_mpirun, run, torchrun

pytestmark = [pytest.mark.launch, needs_mpirun]

EPOCHS = 3
COMMON = ["--model", "resnet_small", "--dataset", "digits", "--image-size", "8", "--epochs", str(EPOCHS),
          "--batch-size", "16", "--lr", "0.05", "--rho1", "0.05", "--rho2", "0.05", "--local-steps", "11",
          "--freeze-round", "4",   # a short run needs the nodes coupled: rho2 = rho1, two rounds an epoch
          "--topk-ratio", "0.05", "--threads", "1"]
STEPS_PER_EPOCH = 1437 // 4 // 16
METHODS = ("dense", "topk", "pactrain", "localsgd", "localsgd-hier", "diloco", "prunex-flat", "prunex")
ROUND_BASED = ("localsgd", "localsgd-hier", "diloco")


def ring_allreduce_cross(nbytes, crossing=2, n=4):
    """Job total over the world group: each crossing rank sends 2(n-1)/n·B (integer, as accounted)."""
    return crossing * (2 * (n - 1) * nbytes // n)


def model_sizes():
    from prunex_hvd.app.models import build
    model = build("resnet_small", num_classes=10, in_channels=1)
    params = [p.numel() for p in model.parameters()]
    floats = [b.numel() for b in model.buffers() if b.is_floating_point()]
    return params, floats


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    proc = run(mpirun(4, [str(BIN / "prunex-hvd"), "compare", "--methods", ",".join(METHODS), *COMMON,
                          "--out", str(out)], ["PRUNEX_RANKS_PER_NODE=2"]), timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return out, proc.stdout, {m: json.loads((out / m / "summary.json").read_text()) for m in METHODS}


def test_every_method_trains_to_a_sensible_accuracy(compared):
    out, stdout, summaries = compared
    for method, s in summaries.items():
        assert s["method"] == method and (s["world_size"], s["num_nodes"]) == (4, 2)
        assert s["final_test_acc"] >= 0.8, (method, s["final_test_acc"])
    table = (out / "comparison.md").read_text()
    assert all(f"| {m} |" in table for m in METHODS) and "× dense bytes" in stdout
    assert (out / "report" / "accuracy_vs_inter_bytes.png").exists()
    # the pruning methods end at the requested kept fraction, the others dense
    assert all(summaries[m]["density"] == 1.0 for m in ("dense", "topk") + ROUND_BASED)
    for m in ("pactrain", "prunex-flat", "prunex"):
        assert 0.45 < summaries[m]["density"] < 0.55, (m, summaries[m]["density"])
    # and PruneX sends the least across nodes
    assert summaries["prunex"]["inter_bytes"] == min(s["inter_bytes"] for s in summaries.values())


def test_dense_bytes_per_step(compared):
    _, _, s = compared
    params, _ = model_sizes()
    steps = EPOCHS * STEPS_PER_EPOCH
    assert s["dense"]["steps"] == steps
    assert s["dense"]["inter_bytes"] == steps * ring_allreduce_cross(4 * sum(params))   # float32 gradients


def test_prunex_flat_bytes_per_round(compared):
    _, _, s = compared
    params, floats = model_sizes()
    dense = 4 * (sum(params) + sum(floats))            # θ+u of every parameter and the BN statistics, one bucket
    # per-layer residual sums (float64), with each rank's round, step count and inf/NaN flag (4 ranks) and the
    # per-layer inf/NaN flags riding along ...
    residuals = (len(params) * 3 + 4 * 3 + len(params) + 1) * 8
    # ... summed over the one group (the world): its allreduce is the job's sum, nothing is broadcast after it
    per_round = ring_allreduce_cross(dense) + ring_allreduce_cross(residuals)
    # the freeze hands rank 0's masks (uint8, rows and columns of every conv) down the world's chain 0→1→2→3:
    # one hop crosses
    from prunex_hvd.app.models import build
    masks = sum(p.shape[0] + p[0].numel() for p in build("resnet_small", num_classes=10, in_channels=1).parameters()
                if p.dim() == 4)
    assert s["prunex-flat"]["inter_bytes"] == s["prunex-flat"]["rounds"] * per_round + masks
    assert s["prunex-flat"]["dense_inter_bytes"] == s["prunex-flat"]["rounds"] * ring_allreduce_cross(dense)


def test_round_based_rivals_bytes_per_round(compared):
    """A round at the same period as PruneX's: the parameters (PyTorch's one flat allreduce) and the float
    buffers (ours) over the world; the hierarchical one's node averages never cross."""
    _, _, s = compared
    params, floats = model_sizes()
    per_round = ring_allreduce_cross(4 * sum(params)) + ring_allreduce_cross(4 * sum(floats))
    for m in ROUND_BASED:
        assert s[m]["rounds"] == s["prunex"]["rounds"] == EPOCHS * STEPS_PER_EPOCH // 11, m
        assert s[m]["inter_bytes"] == s[m]["rounds"] * per_round, m


def test_topk_and_pactrain_send_less_than_dense(compared):
    _, _, s = compared
    assert s["topk"]["inter_bytes"] < 0.25 * s["dense"]["inter_bytes"]
    assert s["pactrain"]["inter_bytes"] < 0.75 * s["dense"]["inter_bytes"]


def test_dense_without_horovod_is_a_bucketed_allreduce(tmp_path):
    """torchrun (no Horovod in the launch): the torch.distributed equivalent, 2 nodes × 1."""
    out = tmp_path / "dense"
    from prunex_hvd.app.cli import flags_for_method
    proc = run(torchrun(2, [str(BIN / "prunex-hvd"), "train", "--method", "dense", *flags_for_method("dense", COMMON),
                            "--epochs", "1", "--out", str(out)]), env={"PRUNEX_RANKS_PER_NODE": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    s = json.loads((out / "summary.json").read_text())
    params, _ = model_sizes()
    steps = 1437 // 2 // 16
    assert s["launcher"] == "torchrun" and s["steps"] == steps
    # two ranks on two nodes: each sends B per allreduce, all of it across
    assert s["inter_bytes"] == steps * ring_allreduce_cross(4 * sum(params), crossing=2, n=2)


@pytest.mark.skipif(not have_horovod(), reason="Horovod is not installed")
def test_dense_under_mpirun_is_horovods_optimizer(compared):
    _, _, s = compared
    assert s["dense"]["launcher"] == "horovod"
