"""`prunex-hvd train` in one process: the CIFAR-10 path end to end on a small file in the real format, and
bad input that must end in a clear error (exit status 2), not a traceback."""
import json
import math
import pickle
import re

import numpy as np
import pytest
import torch

from prunex_hvd.app import cli
from prunex_hvd.app.train import DIVERGING_LOSS, loss_diverges
from training_job import metrics


pytestmark = pytest.mark.usefixtures("single_process")   # conftest.py


def write_cifar(root, per_batch=24, test=20):
    """The standard python-pickle layout of CIFAR-10, small: class k images are brighter in channel k % 3."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)

    def batch(n):
        labels = [int(v) for v in rng.integers(0, 10, n)]
        images = rng.integers(0, 120, (n, 3, 32, 32)).astype(np.uint8)
        for i, k in enumerate(labels):
            images[i, k % 3] += np.uint8(12 * k)
        return {b"batch_label": b"x", b"labels": labels, b"data": images.reshape(n, 3072),
                b"filenames": [b"%d.png" % i for i in range(n)]}
    for b in range(1, 6):
        with open(folder / f"data_batch_{b}", "wb") as f:
            pickle.dump(batch(per_batch), f)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(batch(test), f)


BASE = ["train", "--model", "resnet_small", "--threads", "1"]


def settings_file(path, **settings):
    """A --config file of ``settings`` at ``path``: the flags prepended to a command line that uses it."""
    path.write_text(json.dumps(settings))
    return ["--config", str(path)]


def test_cifar10_from_the_pickle_layout(tmp_path, capsys):
    write_cifar(tmp_path / "data")
    out = tmp_path / "run"
    rc = cli.main(BASE + ["--dataset", "cifar10", "--data-dir", str(tmp_path / "data"), "--image-size", "16",
                          "--batch-size", "16",
                          "--epochs", "2", "--local-steps", "3", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "cifar10" and summary["steps"] == 2 * (120 // 16) and summary["rounds"] == 5
    assert (summary["world_size"], summary["inter_bytes"]) == (1, 0)   # one process sends nothing across nodes
    blob = torch.load(out / "final_model.pt")
    assert (blob["in_channels"], blob["image_size"], blob["num_classes"]) == (3, 16, 10)
    shown = capsys.readouterr()
    assert "final test accuracy" in shown.out
    assert "prunex-hvd: masks chosen from the start weights and frozen before the first step" in shown.err   # the
    # library's log, shown by the command


@pytest.mark.parametrize("args,message", [
    (["--dataset", "cifar10", "--data-dir", "{tmp}/nowhere"], "cifar-10-batches-py"),
    (["--dataset", "cifar10"], "--data-dir"),
    (["--epochs", "0"], "epochs must be a finite number > 0"),
    ([{"bn_recalibrate": -1}], "bn_recalibrate must be an int >= 0"),   # a --config file's setting
    (["--model", "resnet9000"], "resnet_small"),
    (["--model", "torchvision:resnet18"], "torchvision"),
    (["--sparsity", "channel:2"], r"keep ratio must be in \(0, 1\]"),
    (["--sparsity", "{not json"], "does not parse"),
    (["--batch-size", "4000"], "batch"),
    (["--method", "topk", "--coupled"], "--coupled does not apply to --method topk"),
    (["--method", "pactrain", "--coupled"], "--coupled is a PruneX option"),   # single weights: nothing to tie
    (["--method", "dense", "--coupled", "streams"], "--coupled does not apply to --method dense"),
    (["--sparsity", "head:0.5"], r"'head:K' needs attention modules"),
])
def test_bad_input_is_a_clear_error(tmp_path, capsys, args, message):
    if args[:2] == ["--model", "torchvision:resnet18"]:
        try:
            import torchvision  # noqa: F401
            pytest.skip("torchvision imports here")
        except Exception:
            pass
    # a dict among the arguments: those settings in a --config file
    args = [flag for a in args for flag in ([a.replace("{tmp}", str(tmp_path))] if isinstance(a, str) else
                                            settings_file(tmp_path / "settings.json", **a))]
    rc = cli.main(BASE + ["--dataset", "digits", "--epochs", "1", "--out", str(tmp_path / "r")] + args)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("prunex-hvd: error: ") and re.search(message, err), err


def test_an_existing_run_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "r"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"event": "round"}\n')
    rc = cli.main(BASE + ["--dataset", "digits", "--epochs", "1", "--out", str(out)])
    assert rc == 2 and "already holds a run" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == '{"event": "round"}\n'


def test_a_diverging_lr_is_said_once(tmp_path, capsys):
    """A training loss above DIVERGING_LOSS x ln(classes) is said once, on rank 0, with the lr and the warm-up;
    a sound lr says nothing. lr 30 on this task: every epoch's loss far above, so once means once."""
    args = BASE + ["--dataset", "synthetic", "--image-size", "8", "--batch-size", "16", "--epochs", "2",
                   "--method", "dense"]
    assert cli.main(args + ["--lr", "30", "--out", str(tmp_path / "hot")]) == 0
    err = capsys.readouterr().err
    losses = [r["train_loss"] for r in metrics(tmp_path / "hot") if r["event"] == "round"]
    assert sum(loss_diverges(v, 10) for v in losses) >= 2
    assert err.count("diverges") == 1 and re.search(r"epoch 1\.00: training loss \S+, above 1\.5 x", err)
    assert "peak 30, --warmup-epochs 0)" in err
    assert cli.main(args + ["--out", str(tmp_path / "sound")]) == 0
    assert "diverges" not in capsys.readouterr().err


def test_a_loss_diverges_above_the_limit_or_when_not_finite():
    limit = DIVERGING_LOSS * math.log(10)
    assert [loss_diverges(v, 10) for v in (0.1, limit, limit * 1.01, float("inf"), float("nan"))] == \
        [False, False, True, True, True]
    assert loss_diverges(2.0, 2) and not loss_diverges(2.0, 10)   # ln 2 x 1.5 = 1.04


def test_coupled_channels_from_the_command_line(tmp_path, capsys):
    """--coupled: inside each residual block the first conv loses the filters whose channels the second
    conv dropped, so the finalized model is smaller than per-layer channel:0.5 would make it."""
    out = tmp_path / "run"
    rc = cli.main(BASE + ["--dataset", "synthetic", "--image-size", "8", "--batch-size", "16", "--epochs", "1",
                          "--local-steps", "4", "--freeze-round", "1", "--coupled", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    config = json.loads((out / "config.json").read_text())["config"]
    assert (config["coupled"], config["rho_max"]) == (True, "auto")
    # --rho-max auto (the default): the wrapper derives it from the optimizer and says so once, on rank 0
    err = capsys.readouterr().err
    assert err.count("rho balanced up to") == 1
    assert "prunex-hvd: DistributedOptimizer: rho balanced up to rho_max 0.5 = (1 - momentum 0.9) / (lr 0.05 x 4 " \
           "local steps)" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["density"] < 0.47
    state = torch.load(out / "final_model.pt")["state_dict"]
    for block in ("layer1.0", "layer2.0", "layer3.0"):
        dead_in = state[f"{block}.conv2.weight"].abs().sum((0, 2, 3)) == 0
        dead_out = state[f"{block}.conv1.weight"].flatten(1).abs().sum(1) == 0
        assert torch.equal(dead_in, dead_out) and int(dead_in.sum()) == dead_in.numel() // 2


def test_coupled_streams_from_the_command_line(tmp_path, capsys):
    """--coupled streams: every residual stream's channels are live in all of its readers and writers or in
    none, and the blocks' pairs hold as with --coupled; the model is smaller still."""
    from prunex_hvd.engine.dependencies import channel_couplings, channel_streams
    from prunex_hvd.app.models import build
    out = tmp_path / "run"
    rc = cli.main(BASE + ["--dataset", "synthetic", "--image-size", "8", "--batch-size", "16", "--epochs", "1",
                          "--local-steps", "4", "--freeze-round", "1", "--coupled", "streams", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    assert json.loads((out / "config.json").read_text())["config"]["coupled"] == "streams"
    assert json.loads((out / "summary.json").read_text())["density"] < 0.40
    blob = torch.load(out / "final_model.pt")
    state, model = blob["state_dict"], build(blob["model"], 10, 3)
    streams = channel_streams(model)
    assert len(streams) == 2
    for readers, writers in streams:
        live = [state[n].abs().sum((0, 2, 3)) != 0 for n in readers] + \
            [state[n].flatten(1).abs().sum(1) != 0 for n in writers]
        assert all(torch.equal(m, live[0]) for m in live) and int(live[0].sum()) == live[0].numel() // 2
    for consumer, producer in channel_couplings(model).items():
        assert torch.equal(state[consumer].abs().sum((0, 2, 3)) != 0, state[producer].flatten(1).abs().sum(1) != 0)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        cli.main(BASE + ["--coupled", "both"])
    assert stop.value.code == 2 and "argument --coupled: off, pairs or streams, not 'both'" in capsys.readouterr().err


def test_a_vit_with_heads_and_mlp_neurons_from_the_command_line(tmp_path, capsys, monkeypatch):
    """--model vit_tiny --sparsity head:0.5+neuron:0.5 --coupled, augment none: half of every attention
    module's heads and of every MLP's hidden units are zero in the final model, and export removes them."""
    from prunex_hvd.app import data as data_module
    from prunex_hvd.app import export

    seen = []
    real = data_module.ShardedLoader.__init__

    def spy(self, data, *a, **k):   # the augmentation the training loader was handed
        seen.append(data.augment)
        real(self, data, *a, **k)
    monkeypatch.setattr(data_module.ShardedLoader, "__init__", spy)
    out = tmp_path / "vit"
    rc = cli.main(["train", "--model", "vit_tiny", "--dataset", "digits", "--image-size", "8",
                   *settings_file(tmp_path / "settings.json", augment="none"),
                   "--sparsity", "head:0.5+neuron:0.5", "--coupled", "--batch-size", "32", "--epochs", "1",
                   "--local-steps", "6", "--freeze-round", "1", "--threads", "1", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    assert seen and set(seen) == {"none"}
    state = torch.load(out / "final_model.pt")["state_dict"]
    for b in range(4):
        proj = state[f"blocks.{b}.attn.proj.weight"]
        live_heads = [bool(proj[:, h * 32:(h + 1) * 32].any()) for h in range(4)]
        assert sum(live_heads) == 2
        for n in "qkv":
            rows = state[f"blocks.{b}.attn.{n}.weight"].abs().sum(1).view(4, 32).sum(1) != 0
            assert rows.tolist() == live_heads
        hidden = state[f"blocks.{b}.mlp.fc1.weight"].abs().sum(1) != 0
        assert int(hidden.sum()) == 128 and torch.equal(hidden, state[f"blocks.{b}.mlp.fc2.weight"].abs().sum(0) != 0)
    report = export.export_run(str(out), measure=False, samples=64)
    assert report["removed"]["heads_removed"] == 8 and report["ratio"]["params"] < 0.55


def test_a_vit_trains_on_cifar10_at_32x32(tmp_path, capsys):
    """vit_tiny (patch 4) on CIFAR-10's own file layout at 32×32×3, heads and coupled MLP units at 0.5: it learns
    (the small set's class is a colour cue: the loss falls by more than half, test accuracy far above chance),
    and the final model keeps half the heads of every block."""
    write_cifar(tmp_path / "data", per_batch=64, test=40)
    out = tmp_path / "vit-cifar"
    rc = cli.main(["train", "--model", "vit_tiny", "--dataset", "cifar10", "--data-dir", str(tmp_path / "data"),
                   "--image-size", "32", *settings_file(tmp_path / "settings.json", augment="none"),
                   "--sparsity", "head:0.5+neuron:0.5", "--coupled", "--batch-size", "32", "--epochs", "3",
                   "--local-steps", "5", "--threads", "1", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    losses = [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "train_loss" in json.loads(line)]
    summary = json.loads((out / "summary.json").read_text())
    assert losses[-1] < 0.5 * losses[0] and summary["final_test_acc"] >= 0.5, (losses, summary["final_test_acc"])
    blob = torch.load(out / "final_model.pt")
    assert (blob["in_channels"], blob["image_size"], blob["num_classes"]) == (3, 32, 10)
    for b in range(4):
        proj = blob["state_dict"][f"blocks.{b}.attn.proj.weight"]
        assert sum(bool(proj[:, h * 32:(h + 1) * 32].any()) for h in range(4)) == 2
