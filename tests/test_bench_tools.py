"""The benchmark scripts' own bookkeeping (no launches, no namespaces): how the emulated cluster names its jobs
and which rival PruneX is measured against."""
import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


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


@pytest.mark.parametrize("argv,message", [
    (["--methods", "prunex+x,nonsense"], "unknown method(s) ['nonsense']"),
    (["--methods", "prunex+x", "--method-args", "prunex+y=--lr 1"], "--method-args 'prunex+y=--lr 1': expected"),
    (["--methods", "prunex", "--method-args", "prunex=--out x"], "must not hold --method or --out")])
def test_bad_jobs_are_refused_before_anything_is_built(cluster, capsys, argv, message):
    with pytest.raises(SystemExit):
        cluster.main(argv)
    assert message in capsys.readouterr().err
