"""`prunex-hvd train` on 4 ranks as 2 nodes × 2 under real launchers: metrics, summary, the final model,
checkpoint/resume equivalence, refusal of a checkpoint from another job, and the report's files."""
import json
import math
import re
from pathlib import Path

import pytest
import torch

from launching import BIN, mpirun, needs_horovod, needs_mpirun, run, worker_results
from shared_launches import register
from training_job import (AGAIN, ANOTHER, ANOTHER_FILES_GONE, ANOTHER_NEW_RUN, ANOTHER_SETTING, ANOTHER_SPARSITY,
                          ARGS, NODES2, OVERLAP_REF, OVERLAP_RESUMED, OVERLAP_SLICED, RESUMED, SLICED, STEPS, VIT_REF,
                          VIT_RESUMED, VIT_SLICED, assert_same_run, case_run, metrics)

pytestmark = [pytest.mark.launch, needs_mpirun]


def test_metrics_summary_and_final_model(full_run):
    out, stdout = full_run
    assert "final test accuracy" in stdout and "counterfactual, the same rounds sent dense" in stdout
    lines = metrics(out)
    rounds, final = lines[:-1], lines[-1]
    assert [r["event"] for r in rounds] == ["round"] * len(rounds) and final["event"] == "final"
    # a round every 7 steps, and the last 3 steps get a round of their own so the final model includes them
    assert [r["step"] for r in rounds] == list(range(7, STEPS, 7)) + [STEPS]
    assert [r["round"] for r in rounds] == list(range(1, len(rounds) + 1))
    for a, b in zip(rounds, rounds[1:]):
        assert b["wall_s"] > a["wall_s"] and b["inter_bytes"] > a["inter_bytes"]
        assert b["dense_inter_bytes"] > a["dense_inter_bytes"] and b["intra_bytes"] > a["intra_bytes"]
    for r in rounds:
        assert 0 <= r["test_acc"] <= 1 and r["train_loss"] > 0 and r["residuals"] and r["rho"]
        assert set(r["residuals"]["conv1.weight"]) == {"r_intra", "s_intra", "r_inter", "s_inter"}
    assert [r["frozen"] for r in rounds[:2]] == [False, False] and all(r["frozen"] for r in rounds[2:])
    assert rounds[-1]["inter_bytes"] < 0.7 * rounds[-1]["dense_inter_bytes"]

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["world_size"], summary["num_nodes"], summary["ranks_per_node"]) == (4, 2, 2)
    assert summary["final_test_acc"] == final["test_acc"] and summary["steps"] == STEPS
    assert summary["inter_bytes"] == final["inter_bytes"] == rounds[-1]["inter_bytes"]

    # the saved model, scored here in one process, is exactly what the job reported, at the requested density
    from prunex_hvd.app.data import ShardedLoader, load_dataset
    from prunex_hvd.app.models import build
    blob = torch.load(out / "final_model.pt")
    model = build(blob["model"], blob["num_classes"], blob["in_channels"])
    model.load_state_dict(blob["state_dict"])
    model.eval()
    data = load_dataset("digits", image_size=blob["image_size"])
    with torch.no_grad():
        batches = ShardedLoader(data, 64, 0, 1, train=False).batches()
        correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in batches)
    assert correct / len(data.test_y) == pytest.approx(summary["final_test_acc"], abs=1e-12)
    # the recipe's one channel budget across the layers: each conv keeps at least a tenth of its input channels,
    # all of them together no more weights than half of each would, and not half of each
    kept = total = budget = 0
    counts = []
    for name, w in blob["state_dict"].items():
        if w.dim() == 4:
            channels = int((w.abs().sum((0, 2, 3)) != 0).sum())
            assert math.ceil(0.1 * w.shape[1]) <= channels <= w.shape[1], name
            per_channel = w[0, 0].numel() * w.shape[0]
            kept, total = kept + channels * per_channel, total + w.numel()
            budget += math.ceil(0.5 * w.shape[1]) * per_channel
            counts.append((channels, math.ceil(0.5 * w.shape[1])))
    assert kept <= budget and any(c != half for c, half in counts), counts
    assert summary["density"] == pytest.approx(kept / total)


def test_report_draws_the_run(full_run, tmp_path):
    out, _ = full_run
    proc = run([str(BIN / "prunex-hvd"), "report", str(out), "--out", str(tmp_path / "rep")], timeout=120)
    assert proc.returncode == 0, proc.stdout
    for name in ("accuracy_vs_time", "accuracy_vs_inter_bytes", "residuals", "density_per_layer",
                 "communication", "masks_full"):
        png = tmp_path / "rep" / f"{name}.png"
        assert png.read_bytes()[:4] == b"\x89PNG", name
    assert "| full |" in (tmp_path / "rep" / "report.md").read_text()


def test_resume_equals_uninterrupted(full_run, shared_launch):
    ref, _ = full_run
    sliced, printed = case_run(shared_launch, SLICED)
    assert "stopped after round 4" in printed, printed[-4000:]
    assert (sliced / "checkpoint.json").exists() and not (sliced / "summary.json").exists()
    assert len(list((sliced / "ckpt").glob("*.pt"))) == 4
    out, _ = case_run(shared_launch, RESUMED)
    assert_same_run(ref, out)


def test_a_run_is_reproduced_bit_for_bit_from_its_config_json(full_run, shared_launch):
    ref, _ = full_run
    out, _ = case_run(shared_launch, AGAIN)      # `train --config FULL/config.json --out OTHER`, no other flag
    assert_same_run(ref, out)
    a, b = (json.loads((run / "config.json").read_text())["config"] for run in (ref, out))
    assert a.pop("out") != b.pop("out") and a == b            # every setting the same, the folder another


def test_a_vit_with_heads_and_neurons_resumes_bit_for_bit(shared_launch):
    """A ViT's head and hidden-unit masks, sliced at round 4 (after they froze at round 3) and resumed, end where
    an uninterrupted run ends; half of every module's heads are gone in the final model."""
    ref, _ = case_run(shared_launch, VIT_REF)
    _, printed = case_run(shared_launch, VIT_SLICED)
    assert "stopped after round 4" in printed, printed[-4000:]
    out, _ = case_run(shared_launch, VIT_RESUMED)
    assert_same_run(ref, out)
    state = torch.load(out / "final_model.pt")["state_dict"]
    for b in range(4):
        proj = state[f"blocks.{b}.attn.proj.weight"]
        assert sum(bool(proj[:, h * 32:(h + 1) * 32].any()) for h in range(4)) == 2


def test_overlapped_resume_equals_uninterrupted(shared_launch):
    """overlap: the sliced run, checkpointed every round and stopped after round 4, ends bit for bit where an
    uninterrupted run without checkpoints ends: checkpoints do not change an overlapped run. Rounds overlap once
    the masks are frozen (after round 3 here: rounds 1-3 block); folded at the next round (7 steps a round), each
    checkpoint from round 4 on is taken with a round in flight and records it (its exchange completed, not folded
    in). The thread tier resumes every other point of a flight bit for bit (test_engine_threads.py)."""
    ref, _ = case_run(shared_launch, OVERLAP_REF)
    sliced, printed = case_run(shared_launch, OVERLAP_SLICED)
    assert "stopped after round 4" in printed, printed[-4000:]
    tag = json.loads((sliced / "checkpoint.json").read_text())["tag"]
    state = torch.load(sliced / "ckpt" / f"tag{tag:08d}.rank00000.pt", weights_only=False)
    assert "in_flight" in state["state"]["optimizer"]["prunex"]   # round 4 is overlapped
    out, _ = case_run(shared_launch, OVERLAP_RESUMED)
    assert_same_run(ref, out)


def test_checkpoint_of_another_job_is_refused_on_every_rank_and_a_changed_setting_named(shared_launch):
    original, _ = case_run(shared_launch, ANOTHER)
    manifest = (original / "checkpoint.json").read_bytes()
    out, printed = case_run(shared_launch, ANOTHER_SPARSITY)   # resumed with another sparsity: refused
    assert printed.count("cannot resume from") == 4, printed[-4000:]
    assert "sparsity was 'channel:0.5', now 'channel:0.25'" in printed
    assert (out / "checkpoint.json").read_bytes() == manifest
    _, printed = case_run(shared_launch, ANOTHER_SETTING)      # another setting is taken, said once, launch flags not
    assert printed.count("resumed with settings other than the run's so far (its config.json): freeze_round "
                         "3 -> 2\n") == 1, printed[-4000:]
    _, printed = case_run(shared_launch, ANOTHER_NEW_RUN)      # a new run over it is refused too
    assert printed.count("already holds a run") == 4, printed[-4000:]
    assert (original / "checkpoint.json").read_bytes() == manifest
    _, printed = case_run(shared_launch, ANOTHER_FILES_GONE)   # the manifest names files that are gone
    assert printed.count("prunex-hvd: error: ") == 4, printed[-4000:]
    assert all(f"rank0000{r}.pt is missing or unreadable" in printed for r in range(4))


# the job's last case: a finished run takes the job's groups down
HOROVODRUN = register("horovodrun-2x2", "train", "cli_worker", "--", "train", *ARGS, "--epochs", "1", "--out", "{run}")


@needs_horovod
def test_horovodrun_gloo_two_host_names(shared_launch):
    proc, out = shared_launch("horovodrun-2x2")
    worker_results(proc, out, "cli", case=HOROVODRUN)
    summary = json.loads((out / HOROVODRUN / HOROVODRUN / "summary.json").read_text())
    assert (summary["launcher"], summary["num_nodes"], summary["ranks_per_node"]) == ("horovod", 2, 2)
    assert summary["rounds"] == 4 and 0 < summary["inter_bytes"] < summary["dense_inter_bytes"]


def test_example_script_runs(tmp_path):
    example = str(Path(__file__).resolve().parents[2] / "examples" / "train_cifar.py")
    proc = run(mpirun(4, [str(BIN / "python"), example, "--dataset", "digits", "--model", "resnet_small",
                          "--epochs", "2", "--batch-size", "32"], NODES2), timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count("pruned model") == 4, proc.stdout[-4000:]
    # the recipe's one channel budget across the layers: no more weights than half of each layer's channels,
    # the budget nearly filled
    density = re.search(r"epoch 2: round 2, density (\d\.\d+)", proc.stdout)
    assert density and 0.45 < float(density.group(1)) <= 0.5, proc.stdout[-4000:]
