"""prunex_hvd.batchnorm.recalibrate_batchnorm: the statistics are the plain means over the batches of each batch's
mean and unbiased variance (checked by hand), the ranks' weighted average is what one process would hold after
all their batches, and nothing else moves; `prunex-hvd train` evaluates with them and keeps them at the end."""
import copy
import json

import pytest
import torch

from prunex_hvd.app import cli
from prunex_hvd.batchnorm import recalibrate_batchnorm, restore_buffers, snapshot_buffers
from threaded import run_ranks


def two_norms() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 5), torch.nn.BatchNorm1d(5))
    for bn in (net[1], net[5]):   # statistics that are not the reset ones, as after training
        bn.running_mean.fill_(3.0)
        bn.running_var.fill_(7.0)
    return net


def batches(seed: int, count: int, size: int = 6):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, 6, 6, generator=g) * 2 + 1, torch.zeros(size, dtype=torch.long))
            for _ in range(count)]


def by_hand(net: torch.nn.Module, data) -> list:
    """Per BatchNorm layer, (mean over batches of the batch mean, ... of the unbiased batch variance), each batch
    normalised by its own statistics on the way (train mode), with the weights as they are."""
    net = copy.deepcopy(net).train()
    seen = {1: [], 5: []}
    hooks = [net[i].register_forward_pre_hook(lambda m, a, i=i: seen[i].append(a[0].detach())) for i in seen]
    with torch.no_grad():
        for x, _ in data:
            net(x)
    for h in hooks:
        h.remove()
    out = []
    for i, inputs in seen.items():
        dims = [0, 2, 3] if inputs[0].dim() == 4 else [0]
        out.append((torch.stack([t.mean(dims) for t in inputs]).mean(0),
                    torch.stack([t.var(dims, unbiased=True) for t in inputs]).mean(0)))
    return out


def stats(net):
    return [(net[i].running_mean.clone(), net[i].running_var.clone()) for i in (1, 5)]


def test_one_process_holds_the_means_over_its_first_batches():
    net, data = two_norms(), batches(1, 5)
    weights = [p.clone() for p in net.parameters()]
    rng = torch.get_rng_state()
    net.eval()
    assert recalibrate_batchnorm(net, iter(data), num_batches=3) == 3
    for (mean, var), (want_mean, want_var) in zip(stats(net), by_hand(net, data[:3])):
        torch.testing.assert_close(mean, want_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(var, want_var, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(p, w) for p, w in zip(net.parameters(), weights))   # weights held
    assert torch.equal(torch.get_rng_state(), rng) and not net.training      # no draws; eval mode kept
    assert net[1].momentum == 0.1   # update_bn's cumulative average is undone


def test_the_ranks_agree_with_one_process_over_all_their_batches():
    """Unequal batch counts per rank (one rank has none): each rank's share is weighted by its count."""
    counts = [2, 0, 3, 1]
    nets = [two_norms() for _ in counts]
    data = [batches(10 + r, n) for r, n in enumerate(counts)]

    def work(rank):
        r = rank.topo.rank
        used = recalibrate_batchnorm(nets[r], iter(data[r]), num_batches=8, world=rank.groups.world)
        return used, stats(nets[r]), rank.ledger.summary(by_op=True)
    results = run_ranks(2, 2, work)
    assert {used for used, _, _ in results} == {sum(counts)}
    assert all(int(net[i].num_batches_tracked) == sum(counts) for net in nets for i in (1, 5))
    reference = by_hand(two_norms(), [b for rank_data in data for b in rank_data])
    for _, got, ledger in results:
        for (mean, var), (m0, v0), (want_mean, want_var) in zip(got, results[0][1], reference):
            assert torch.equal(mean, m0) and torch.equal(var, v0)   # the same model on every rank
            torch.testing.assert_close(mean, want_mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(var, want_var, rtol=1e-5, atol=1e-6)
        ops = [op for tier in ledger.values() for op in tier.get("by_op", {})]
        assert ops and all(op.endswith("[eval]") for op in ops), ledger   # evaluation's bytes, not training's


def test_no_batches_anywhere_is_an_error_on_every_rank():
    nets = [two_norms() for _ in range(3)]

    def work(rank):
        try:
            recalibrate_batchnorm(nets[rank.topo.rank], iter([]), num_batches=4, world=rank.groups.world)
        except ValueError as exc:
            return str(exc)
    messages = run_ranks(1, 3, work)
    assert all(m and "no rank's batches yielded anything" in m for m in messages), messages
    with pytest.raises(ValueError, match="yielded nothing"):
        recalibrate_batchnorm(two_norms(), iter([]), num_batches=4)


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, None])
def test_a_bad_batch_count_is_refused(bad):
    with pytest.raises(ValueError, match="num_batches must be an int >= 1"):
        recalibrate_batchnorm(two_norms(), iter(batches(0, 2)), num_batches=bad)


def test_a_model_without_batchnorm_is_left_alone():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    before = copy.deepcopy(net.state_dict())
    assert recalibrate_batchnorm(net, iter([torch.randn(2, 4)]), num_batches=1) == 0
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_snapshot_and_restore_put_every_buffer_back():
    net = two_norms()
    saved = snapshot_buffers(net)
    recalibrate_batchnorm(net, iter(batches(2, 2)), num_batches=2)
    assert int(net[1].num_batches_tracked) == 2 and float(net[1].running_mean[0]) != 3.0
    restore_buffers(net, saved)
    assert int(net[1].num_batches_tracked) == 0 and torch.equal(net[1].running_mean, torch.full((4,), 3.0))


def recalibrating(folder, batches):
    """The command line's flags for ``bn_recalibrate=batches`` (a --config file's setting, written in
    ``folder``)."""
    path = folder / f"recalibrate-{batches}.json"
    path.write_text(json.dumps({"bn_recalibrate": batches}))
    return ["--config", str(path)]


@pytest.mark.usefixtures("single_process")   # conftest.py
def test_train_evaluates_recalibrated_and_trains_the_same(tmp_path, capsys):
    """The same job with and without recalibration: the same training (curve of the round's statistics, final
    weights), a final model that keeps statistics of its own weights, and its accuracy in the summary."""
    args = ["train", "--model", "resnet_small", "--dataset", "digits", "--threads", "1",
            "--epochs", "2", "--batch-size", "32", "--local-steps", "20"]
    assert cli.main(args + [*recalibrating(tmp_path, 0), "--out", str(tmp_path / "off")]) == 0, capsys.readouterr()
    assert cli.main(args + [*recalibrating(tmp_path, 3), "--out", str(tmp_path / "on")]) == 0, capsys.readouterr()
    rounds = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
              for name in ("off", "on")}
    off = [r for r in rounds["off"] if r.get("test_acc") is not None]
    on = [r for r in rounds["on"] if r.get("test_acc") is not None]
    assert len(on) == len(off) >= 3 and all("test_acc_no_recal" not in r for r in off)
    assert [r["test_acc_no_recal"] for r in on] == [r["test_acc"] for r in off]
    assert any(r["test_acc"] != r["test_acc_no_recal"] for r in on)   # scored after the recalibration
    assert [r.get("train_loss") for r in on] == [r.get("train_loss") for r in off]
    final = {name: torch.load(tmp_path / name / "final_model.pt")["state_dict"] for name in ("off", "on")}
    bn = [k for k in final["on"] if k.endswith("running_mean")]
    assert bn and all(torch.equal(final["on"][k], final["off"][k]) for k in final["on"]
                      if not k.endswith(("running_mean", "running_var", "num_batches_tracked")))
    assert any(not torch.equal(final["on"][k], final["off"][k]) for k in bn)
    summary = json.loads((tmp_path / "on" / "summary.json").read_text())
    per_epoch = summary["steps"] // 2   # the final model's statistics: a whole epoch of batches, not 3
    assert int(final["on"]["bn1.num_batches_tracked"]) == per_epoch > 3
    assert summary["final_test_acc_no_recal"] == json.loads((tmp_path / "off" / "summary.json").read_text())[
        "final_test_acc"]


def test_world_is_a_communicator_auto_or_none():
    with pytest.raises(ValueError, match="world must be a communicator, 'auto' or None"):
        recalibrate_batchnorm(two_norms(), iter(batches(0, 2)), num_batches=2, world="everyone")
    assert recalibrate_batchnorm(two_norms(), iter(batches(0, 2)), num_batches=2, world=None) == 2


@pytest.mark.usefixtures("single_process")   # conftest.py
def test_the_final_statistics_stop_at_the_cap(tmp_path, capsys, monkeypatch):
    """An epoch longer than FINAL_BN_BATCHES: the final model's statistics come from that many batches."""
    from prunex_hvd.app import train
    monkeypatch.setattr(train, "FINAL_BN_BATCHES", 5)
    args = ["train", "--model", "resnet_small", "--dataset", "digits", "--threads", "1",
            "--epochs", "1", "--batch-size", "32", "--local-steps", "20", *recalibrating(tmp_path, 3),
            "--out", str(tmp_path / "run")]
    assert cli.main(args) == 0, capsys.readouterr()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    final = torch.load(tmp_path / "run" / "final_model.pt")["state_dict"]
    assert summary["steps"] > 5 and int(final["bn1.num_batches_tracked"]) == 5
