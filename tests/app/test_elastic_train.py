"""`prunex-hvd train --elastic` in one process (no elastic launch: it runs once, fail-fast): the data by a cursor,
the lr by epoch, and a checkpoint that resumes bit for bit. A node lost and brought back under horovodrun's
elastic mode: tests/launch/test_elastic_launch.py."""
import math
import os
import shutil

import pytest

from prunex_hvd.app import cli
from prunex_hvd.app.elastic_train import lr_at
from prunex_hvd.app.train import TrainConfig, train
from training_job import assert_same_run, metrics

pytestmark = pytest.mark.usefixtures("single_process")   # conftest.py

ARGS = ["train", "--elastic", "--model", "resnet_small", "--dataset", "digits", "--image-size", "8", "--epochs",
        "1.5", "--local-steps", "5", "--batch-size", "32", "--threads", "1"]


def test_the_lr_follows_the_epochs_done():
    cfg = TrainConfig(elastic=True, epochs=10, lr=0.1, warmup_epochs=2)
    assert lr_at(cfg, 1.0) == pytest.approx(0.05)
    assert lr_at(cfg, 2.0) == pytest.approx(0.1)
    assert lr_at(cfg, 6.0) == pytest.approx(0.05)
    assert lr_at(cfg, 10.0) == pytest.approx(0.0, abs=1e-12)
    assert lr_at(TrainConfig(elastic=True, epochs=10, lr=0.1, warmup_epochs=0, lr_schedule="constant"), 7) == 0.1


def test_a_run_and_its_checkpoint_resumed_end_bit_for_bit(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("PRUNEX_TIMEOUT_S", "600")   # (restored after the test: the run sets it)
    assert cli.main(ARGS + ["--out", str(run), "--checkpoint-every", "7", "--timeout", "45"]) == 0
    assert "a lost rank ends the job" in capsys.readouterr().err
    # every change of nodes forms the job with --timeout (through the env: the forming reads it there)
    assert float(os.environ["PRUNEX_TIMEOUT_S"]) == 45
    rounds = [r for r in metrics(run) if r["event"] == "round"]
    # one rank: each step takes the next 32 of the epoch's 1,437 samples; the epoch's last partial batch is dropped,
    # and the run ends at the step that passes 1.5 epochs
    assert rounds[-1]["step"] == 1437 // 32 + math.ceil(0.5 * 1437 / 32) and {r["ranks"] for r in rounds} == {1}
    lrs = [r["lr"] for r in rounds]
    assert lrs[0] < max(lrs) and lrs[-1] < max(lrs)   # a warm-up, then the cosine
    again = tmp_path / "again"
    shutil.copytree(run, again)
    for name in ("summary.json", "final_model.pt"):
        (again / name).unlink()
    assert cli.main(ARGS + ["--out", str(again), "--checkpoint-every", "7", "--resume"]) == 0
    assert_same_run(run, again)


def test_elastic_refuses_what_it_does_not_run(tmp_path, capsys):
    assert cli.main(["train", "--elastic", "--method", "dense", "--out", str(tmp_path / "x")]) == 2
    assert "--elastic does not apply to --method dense" in capsys.readouterr().err
    assert cli.main(ARGS + ["--stop-after-rounds", "2", "--out", str(tmp_path / "y")]) == 2
    assert "--stop-after-rounds with --elastic" in capsys.readouterr().err
    with pytest.raises(ValueError, match="elastic training runs PruneX"):
        TrainConfig(elastic=True, method="localsgd").validate()
    with pytest.raises(ValueError, match="runs in prunex_hvd.app.elastic_train.train_elastic"):
        train(TrainConfig(elastic=True, out=str(tmp_path / "z")))
