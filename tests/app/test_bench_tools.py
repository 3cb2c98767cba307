"""The benchmark scripts' own bookkeeping (no launches, no namespaces): how the emulated cluster names its jobs
and which rival PruneX is measured against."""
import importlib.util
import json
from types import SimpleNamespace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cluster():
    return _load("emulated_cluster")


@pytest.mark.parametrize("entry,want", [("prunex", ("prunex", "")), ("dense@mpi", ("dense", "mpi")),
                                        ("prunex+nosync", ("prunex", "")), ("prunex+a@horovod", ("prunex", "horovod"))])
def test_a_job_is_method_label_and_plane(cluster, entry, want):
    assert cluster.parse_method(entry) == want


def test_prunex_jobs_against_the_fastest_round_based_rival(cluster):
    rows = {"localsgd": {"time_to_target_s": 120.0}, "localsgd-hier": {"time_to_target_s": 80.0},
            "diloco": {"time_to_target_s": None}, "dense": {"time_to_target_s": 10.0},   # not a round-based rival
            "prunex": {"time_to_target_s": 40.0}, "prunex+paper": {"time_to_target_s": None},
            "prunex+nosync": {"time_to_target_s": 100.0}}
    assert cluster.rival_speedups(rows) == {"best_round_based_rival": "localsgd-hier",
                                            "best_rival_time_to_target_s": 80.0,
                                            "prunex_speedup_vs_best_rival": 2.0,
                                            "prunex+nosync_speedup_vs_best_rival": 0.8}
    assert cluster.rival_speedups({"prunex": {"time_to_target_s": 5.0}, "diloco": {}}) == {}


def test_overlapped_jobs_against_their_blocking_twins(cluster):
    rows = {"prunex": {"exchange_wait_s": 40.0, "time_to_target_s": 30.0, "train_wall_s": 100.0},
            "prunex+ov2": {"exchange_wait_s": 4.0, "time_to_target_s": 24.0, "train_wall_s": 80.0},
            "prunex+fp32": {"exchange_wait_s": 100.0, "time_to_target_s": 60.0, "train_wall_s": 200.0},
            "prunex+fp32-overlap": {"exchange_wait_s": 1.0, "time_to_target_s": None, "train_wall_s": 110.0}}
    got = cluster.overlap_pairs(rows, {"prunex+ov2", "prunex+fp32-overlap"})
    assert got == {"prunex+ov2": {"blocking": "prunex", "exposed_wait_ratio": 0.1, "time_to_target_ratio": 0.8,
                                  "train_wall_ratio": 0.8},
                   "prunex+fp32-overlap": {"blocking": "prunex+fp32", "exposed_wait_ratio": 0.01,
                                           "time_to_target_ratio": None, "train_wall_ratio": 0.55}}
    assert cluster.overlap_pairs(rows, set()) == {}
    rows["prunex"]["frozen_exchange_wait_per_round_s"] = 1.3   # overlapped once frozen: those rounds compared
    rows["prunex+ov2"]["frozen_exchange_wait_per_round_s"] = 0.013
    assert cluster.overlap_pairs(rows, {"prunex+ov2"})["prunex+ov2"]["frozen_exposed_wait_ratio"] == 0.01


def test_the_wait_after_the_freeze_is_read_from_the_metrics(cluster, tmp_path):
    """Rank 0's cumulative exchange wait at the round that froze the masks and at the end: the rounds after."""
    def rnd(k, acc, frozen, wait):
        return {"event": "round", "round": k, "epoch": k / 2, "wall_s": 4.0 * k, "test_acc": acc, "frozen": frozen,
                "exchange_wait_s": wait}
    recs = [rnd(1, 0.5, False, 1.2), rnd(2, 0.7, True, 2.5), rnd(3, 0.8, True, 2.6), rnd(4, 0.9, True, 2.9),
            {"event": "final", "round": 4, "wall_s": 16.0, "test_acc": 0.9}]   # no exchange wait in it
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = cluster.read_metrics(str(tmp_path), 0.8)
    assert got["frozen_exchange_wait_per_round_s"] == 0.2 and got["time_to_target_s"] == 12.0
    recs[1]["frozen"] = False   # frozen at the last round: no round after it
    recs[2]["frozen"] = False
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert "frozen_exchange_wait_per_round_s" not in cluster.read_metrics(str(tmp_path), 0.8)


def test_stop_at_target_ends_a_job_once_its_metrics_reach_the_target(cluster, tmp_path):
    """--stop-at-target: the job is stopped at the first round at the target, not at its end or its timeout;
    without a target the wait is plain (exit code, or TimeoutExpired)."""
    import subprocess
    import sys
    rows = [{"event": "round", "round": k, "epoch": k / 2, "wall_s": float(k), "test_acc": acc}
            for k, acc in ((1, 0.5), (2, 0.85))]
    script = ("import json, time, sys\n"
              f"for r in {rows!r}:\n"
              "    time.sleep(0.5)\n"
              f"    open({str(tmp_path / 'metrics.jsonl')!r}, 'a').write(json.dumps(r) + '\\n')\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        with pytest.raises(cluster.TargetReached):
            cluster.wait_for_job(proc, 30, str(tmp_path), 0.8)
        assert proc.poll() is None   # still running: stopping it is the caller's (kill_group)
    finally:
        proc.kill()
        proc.wait()
    assert cluster.read_metrics(str(tmp_path), 0.8)["time_to_target_s"] == 2.0
    quick = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert cluster.wait_for_job(quick, 30, str(tmp_path / "none"), None) == 3
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):   # never at the target (0.9): the timeout still counts
            cluster.wait_for_job(slow, 1.5, str(tmp_path), 0.9)
    finally:
        slow.kill()
        slow.wait()


@pytest.mark.parametrize("argv,message", [
    (["--methods", "prunex+x,nonsense"], "unknown method(s) ['nonsense']"),
    (["--methods", "prunex+x", "--method-args", "prunex+y=--lr 1"], "--method-args 'prunex+y=--lr 1': expected"),
    (["--methods", "prunex", "--method-args", "prunex=--out x"], "must not hold --method or --out")])
def test_bad_jobs_are_refused_before_anything_is_built(cluster, capsys, argv, message):
    with pytest.raises(SystemExit):
        cluster.main(argv)
    assert message in capsys.readouterr().err


def test_hosts_fill_racks_in_order_one_switch_each(cluster):
    assert cluster.rack_of_hosts(4, 2) == [0, 0, 1, 1]
    assert cluster.rack_of_hosts(6, 3) == [0, 0, 1, 1, 2, 2]
    assert cluster.host_switches(4, 2) == ["pxhsw0", "pxhsw0", "pxhsw1", "pxhsw1"]
    assert cluster.host_switches(3, 1) == ["pxhsw"] * 3   # one rack: the single switch of old
    assert cluster.switch_names(3) == ["pxhsw0", "pxhsw1", "pxhsw2"]
    with pytest.raises(ValueError, match="do not split into 2 racks"):
        cluster.rack_of_hosts(5, 2)


def test_every_namespace_of_a_rack_build_is_ours(cluster, monkeypatch):
    listed = "pxh0 (id: 3)\npxh12\npxhsw\npxhsw0\npxhsw11\npxhspine\npxhrun\npxhswx\nother\npxh\n"
    monkeypatch.setattr(cluster, "sh", lambda *cmd, **kw: cluster.subprocess.CompletedProcess(cmd, 0, listed, ""))
    assert cluster.our_namespaces() == ["pxh0", "pxh12", "pxhsw", "pxhsw0", "pxhsw11", "pxhspine", "pxhrun"]
    # teardown deletes the switches first (each takes its veth ends, and so their peers, with it)
    assert [n for n in cluster.our_namespaces() if cluster.is_switch(n)] == ["pxhsw", "pxhsw0", "pxhsw11", "pxhspine"]


def test_uneven_racks_are_refused_before_anything_is_built(cluster, capsys):
    with pytest.raises(SystemExit):
        cluster.main(["--hosts", "6", "--racks", "4"])
    assert "--racks 4: the 6 hosts do not split into 4 racks of equal size" in capsys.readouterr().err


def test_jobs_learn_the_racks_first_in_their_arguments(cluster):
    args = SimpleNamespace(hosts=4, racks=2, train_args="--epochs 2 --lr 0.1",
                           method_args={"prunex+flat": "--nodes-per-rack 4"})
    assert cluster.job_argv(args, "localsgd", "/o") == [
        "--nodes-per-rack", "2", "--epochs", "2", "--lr", "0.1", "--method", "localsgd", "--out", "/o"]
    # a method's own --nodes-per-rack comes later, and so wins
    assert cluster.job_argv(args, "prunex+flat", "/o")[-6:] == [
        "--nodes-per-rack", "4", "--method", "prunex", "--out", "/o"]
    args.racks = 1   # no racks: the arguments of old
    assert cluster.job_argv(args, "localsgd@mpi", "/o") == [
        "--epochs", "2", "--lr", "0.1", "--method", "localsgd", "--out", "/o"]


def test_each_method_gets_the_shared_arguments_that_apply_to_it(cluster):
    """The cluster's shared --train-args hold PruneX's flags: a rival's job goes without them (train refuses a
    flag that does not apply to its --method), flags and their values both."""
    args = SimpleNamespace(hosts=4, racks=1, method_args={},
                           train_args="--epochs 2 --sparsity channel:0.5 --rho1 0.05 --coupled --topk-ratio 0.01 "
                                      "--local-steps 11 --no-node-sync --overlap=on")
    assert cluster.job_argv(args, "dense", "/o") == [
        "--epochs", "2", "--local-steps", "11", "--method", "dense", "--out", "/o"]
    assert cluster.job_argv(args, "topk", "/o") == [
        "--epochs", "2", "--topk-ratio", "0.01", "--local-steps", "11", "--method", "topk", "--out", "/o"]
    assert cluster.job_argv(args, "pactrain", "/o") == [
        "--epochs", "2", "--sparsity", "channel:0.5", "--coupled", "--local-steps", "11", "--method", "pactrain",
        "--out", "/o"]
    assert cluster.job_argv(args, "prunex", "/o")[:-4] == args.train_args.replace("0.01 ", "").replace(
        "--topk-ratio ", "").split()


def test_the_launchers_htb_counters_are_read_per_rack(cluster):
    text = ("class htb 1:1 root prio 0 rate 100Gbit ceil 100Gbit burst 1Mb cburst 1Mb \n"
            " Sent 4200 bytes 12 pkt (dropped 0, overlimits 0 requeues 0) \n backlog 0b 0p requeues 0\n"
            "class htb 1:a root prio 0 rate 100Gbit ceil 100Gbit burst 1Mb cburst 1Mb \n"
            " Sent 77 bytes 1 pkt (dropped 0, overlimits 0 requeues 0) \n")
    assert cluster.parse_htb_bytes(text) == {0: 4200, 9: 77}


def _stats(tx=0, rx=0, txp=0, rxp=0):
    return {"tx_bytes": tx, "tx_packets": txp, "rx_bytes": rx, "rx_packets": rxp}


def test_spine_bytes_leave_out_the_launchers_traffic_with_other_racks(cluster, monkeypatch):
    """4 hosts in 2 racks, launcher in rack 0: its 80 B to rack 1 leave over rack 0's uplink and enter over rack
    1's, its 120 B from rack 1 the other way; what rack 0's hosts exchange with it never reaches the spine."""
    after = {("pxh0", "eth0"): _stats(1000, txp=10), ("pxh1", "eth0"): _stats(2000, txp=20),
             ("pxh2", "eth0"): _stats(3000, txp=30), ("pxh3", "eth0"): _stats(4000, txp=40),
             ("pxhsw0", "h0"): _stats(900), ("pxhsw0", "h1"): _stats(1900), ("pxhsw1", "h2"): _stats(2900),
             ("pxhsw1", "h3"): _stats(3900), ("pxhrun", "eth0"): _stats(140, 220, 2, 3),
             ("pxhsw0", "uplink"): _stats(5000), ("pxhsw1", "uplink"): _stats(4000),
             ("pxhspine", "rack0"): _stats(4010), ("pxhspine", "rack1"): _stats(5000)}
    launcher = {("pxhrun", "eth0"): {0: 60, 1: 80}, ("pxhsw0", "run"): {0: 100, 1: 120}}
    zero = True
    monkeypatch.setattr(cluster, "read_stats", lambda ns, dev: _stats() if zero else after[ns, dev])
    monkeypatch.setattr(cluster, "read_launcher_by_rack",
                        lambda ns, dev: dict.fromkeys(launcher[ns, dev], 0) if zero else launcher[ns, dev])
    before = cluster.snapshot(4, racks=2)
    zero = False
    got = cluster.kernel_traffic(before, cluster.snapshot(4, racks=2), 4, racks=2)
    assert got["kernel_inter_bytes"] == 10000 - 220 and got["kernel_inter_packets"] == 100 - 3
    assert got["kernel_inter_bytes_switch"] == 9600 - 140
    assert got["kernel_spine_bytes_by_link"] == {"pxhsw0/uplink": {"out_bytes": 4920, "in_bytes": 3890},
                                                 "pxhsw1/uplink": {"out_bytes": 3880, "in_bytes": 4920}}
    assert got["kernel_spine_bytes"] == 8800 and got["kernel_spine_bytes_spine_side"] == 8810
    assert got["kernel_spine_launcher_bytes"] == 200
    # one rack: the counters and keys of old, no spine
    del after["pxhsw0", "h0"], after["pxhsw0", "h1"], after["pxhsw1", "h2"], after["pxhsw1", "h3"]
    after.update({("pxhsw", f"h{k}"): _stats(900 + 1000 * k) for k in range(4)})
    zero = True
    before = cluster.snapshot(4)
    zero = False
    got = cluster.kernel_traffic(before, cluster.snapshot(4), 4)
    assert sorted(got) == ["kernel_inter_bytes", "kernel_inter_bytes_switch", "kernel_inter_packets",
                           "kernel_inter_payload_bytes_est", "kernel_launcher_bytes", "kernel_tx_bytes_by_host"]
    assert got["kernel_inter_bytes_switch"] == 9600 - 140


def test_the_ledgers_cross_rack_bytes_are_read_with_racks_only(cluster, tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "final", "round": 4, "wall_s": 16.0}) + "\n")
    rank = {"total": {"cross_node_bytes": 500, "cross_rack_bytes": 200}}
    (tmp_path / "ledger.json").write_text(json.dumps({
        "cross_node_bytes": 1000, "ranks": [rank, rank],
        "by_tier_op": {"inter:allreduce": {"cross_node_bytes": 1000, "cross_rack_bytes": 400},
                       "intra:allreduce": {"cross_node_bytes": 0, "cross_rack_bytes": 0}}}))
    got = cluster.read_metrics(str(tmp_path), 0.9, racks=2)
    assert got["library_ledger_cross_node_bytes"] == 1000 and got["library_ledger_cross_rack_bytes"] == 400
    assert got["library_ledger_cross_rack_by_op"] == {"inter:allreduce": 400}
    assert "library_ledger_cross_rack_bytes" not in cluster.read_metrics(str(tmp_path), 0.9)
    (tmp_path / "ledger.json").unlink()   # a failed job writes none
    assert cluster.read_metrics(str(tmp_path), 0.9, racks=2)["library_ledger_cross_rack_bytes"] is None


def test_the_learning_report_draws_each_task_and_tables_the_means(tmp_path):
    """benchmarks/report.py on bench_learning's JSON: a plot per task, and per variant the mean final accuracy and
    the mean epochs to each target over the seeds that reached it (counted where some did not)."""
    report = _load("report")

    def run(variant, seed, final, reached):
        return {"task": "digits", "variant": variant, "seed": seed, "rc": 0, "final_acc": final,
                "curve": [[1.0, 0.5], [2.0, final]], "epochs_to": {"0.9": reached, "0.95": None}}
    d = {"bench": "learning", "runs": [run("a", 0, 0.9, 2.0), run("a", 1, 0.96, 1.0), run("b", 0, 0.92, None),
                                       dict(run("b", 1, 0.5, None), rc=1)]}   # a failed run counts nowhere
    (tmp_path / "l.json").write_text(json.dumps(d))
    assert report.main([str(tmp_path / "l.json"), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "learning-digits.png").stat().st_size > 0
    md = (tmp_path / "r" / "bench.md").read_text()
    assert "| a | 2 | 93.00 | 1.5 / never |" in md and "| b | 1 | 92.00 | never / never |" in md
    d["runs"][1]["epochs_to"]["0.95"] = 2.0
    (tmp_path / "l.json").write_text(json.dumps(d))
    assert report.main([str(tmp_path / "l.json"), "--out", str(tmp_path / "r"), "--variants", "a"]) == 0
    md = (tmp_path / "r" / "bench.md").read_text()
    assert "| a | 2 | 93.00 | 1.5 / 2.0 (1 of 2) |" in md and "| b |" not in md
    d["runs"].append(dict(run("a", 0, 0.8, None), extra="--warmup-epochs 0"))   # bench_learning --extra: its own row
    (tmp_path / "l.json").write_text(json.dumps(d))
    assert report.main([str(tmp_path / "l.json"), "--out", str(tmp_path / "r"), "--variants", "a"]) == 0
    md = (tmp_path / "r" / "bench.md").read_text()
    assert "| a | 2 | 93.00 |" in md and "| a --warmup-epochs 0 | 1 | 80.00 | never / never |" in md


def test_bench_learning_summarizes_each_extra_apart():
    """bench_learning's summary: one row per task, variant and --extra flags (merged sweeps stay apart)."""
    learning = _load("bench_learning")

    def run(seed, final, extra=None):
        rec = {"task": "digits", "variant": "localsgd", "seed": seed, "rc": 0, "final_acc": final,
               "curve": [[1.0, final]], "epochs_to": {"0.9": 1.0, "0.95": None, "0.97": None}, "density": 1.0,
               "inter_bytes": 10}
        return dict(rec, extra=extra) if extra else rec
    rows = learning.summarize([run(0, 0.9), run(1, 0.96), run(0, 0.8, "--warmup-epochs 2")])
    assert [(r.get("extra"), r["runs"], round(r["final_acc"], 4)) for r in rows] == \
        [(None, 2, 0.93), ("--warmup-epochs 2", 1, 0.8)]
