"""The console script under a real launch, and the Makefile's interpreter lookup."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launching import BIN, mpirun, needs_mpirun, run, worker_results
from shared_launches import register

REPO = Path(__file__).resolve().parents[2]


@needs_mpirun
@pytest.mark.launch
def test_info_probe_counts_leader_bytes_only():
    proc = run(mpirun(4, [str(BIN / "prunex-hvd"), "info", "--ranks-per-node", "2", "--probe-mb", "1",
                          "--json"]), timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert report["backends"]["mpi"] == "ok" and len(report["ranks"]) == 4
    mib = 2**20
    for row in report["ranks"]:
        t, probe = row["topology"], row["probe"]
        # leaders: one inter-node allreduce of 1 MiB between 2 nodes sends exactly 1 MiB across
        assert probe["total"]["cross_node_bytes"] == (mib if t["is_leader"] else 0)
        assert probe["inter"]["payload_bytes"] == (mib if t["is_leader"] else 0)
        assert probe["intra"]["payload_bytes"] == 2 * mib  # the node sum and the broadcast back


def test_cli_usage_error_is_friendly():
    proc = subprocess.run([str(BIN / "prunex-hvd"), "info", "--backend", "carrier-pigeon"], capture_output=True,
                          text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI"))})
    assert proc.returncode == 2
    assert "prunex-hvd: error: unknown backend 'carrier-pigeon'" in proc.stderr


@pytest.mark.skipif(not (REPO / "Makefile").exists(), reason="needs the source tree")
def test_make_python_prints_the_env_interpreter():
    out = subprocess.run(["make", "-s", "python"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout.strip()
    assert os.path.isabs(out) and Path(out).exists()
    assert subprocess.run([out, "-c", "import prunex_hvd"], timeout=120).returncode == 0
    if Path(sys.executable).parent.parent == REPO / ".venv":
        assert Path(out) == Path(sys.executable)


RACKS_DISAGREE = register("mpirun-racks", "racks-disagree", "rack_worker", "--backend", "mpi", "--disagree", "5")
RACKS_INFO = register("mpirun-racks", "info", "cli_worker", "--", "info", "--json")


@needs_mpirun
@pytest.mark.launch
def test_info_shows_racks_from_the_environment(shared_launch):
    """8 ranks as 2 racks × 2 nodes × 2 (PRUNEX_RANKS_PER_NODE, PRUNEX_NODES_PER_RACK): every rank's topology,
    and a value the ranks disagree on (one rank told 4) is one error on every rank."""
    proc, out = shared_launch("mpirun-racks")
    worker_results(proc, out, "cli", ranks=8, case=RACKS_INFO)
    printed = (out / RACKS_INFO / "output.rank0.txt").read_text()
    ranks = [row["topology"] for row in json.loads(printed[printed.index("{"):])["ranks"]]
    assert [(t["rack"], t["node"], t["is_rack_leader"]) for t in ranks] == \
        [(r // 4, r // 2, r % 4 == 0) for r in range(8)]
    assert {str(t["rack_nodes"]) for t in ranks} == {"[[0, 1], [2, 3]]"}
    worker_results(proc, out, "rack", ranks=8, case=RACKS_DISAGREE)
    # mpirun may join two ranks' lines into one: find every rank's message in the whole output
    said = re.findall(r"\[rank (\d)\] refused: ranks disagree about nodes_per_rack \(PRUNEX_NODES_PER_RACK\): "
                      r"2 on ranks 0,1,2,3,4,6,7; 4 on ranks 5\.", proc.stdout)
    assert sorted(map(int, said)) == list(range(8)), proc.stdout[-3000:]


# -- train's flags: the recipe's few, each with its default; the removed ones and the config-only ones named -----

def _train_config(*argv):
    """``prunex-hvd train ARGV``'s TrainConfig, as main() builds it (no launch)."""
    from prunex_hvd.app import cli
    return cli._train_config(cli.parse(["train", *argv]))


def _exits(argv, capsys):
    """main(argv)'s exit status and what it wrote, for a command line refused before anything runs."""
    from prunex_hvd.app import cli
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def test_train_help_shows_at_most_41_options_each_with_its_default(capsys):
    code, out, _ = _exits(["train", "--help"], capsys)
    assert code == 0
    entries, entry = [], None   # each option's lines: from its "  -X" line to the next one or a group's heading
    for line in out.splitlines():
        if re.match(r"  -", line):
            entry = [line]
            entries.append(entry)
        elif entry is not None and line.startswith("   "):
            entry.append(line)
        else:
            entry = None
    options = {re.match(r"\s*(-[-\w]+)", e[0]).group(1): " ".join(s.strip() for s in e) for e in entries}
    assert 30 <= len(options) <= 41, sorted(options)
    assert {"-h", "--sparsity", "--rho-max", "--overlap", "--paper", "--config", "--warmup-epochs",
            "--elastic"} <= set(options)
    assert [o for o, text in options.items() if o != "-h" and "(default:" not in text] == []
    assert "(default:" not in options["-h"]


@pytest.mark.parametrize("argv, said", [
    (["train", "--method", "locsgd"], "argument --method: unknown method 'locsgd' (did you mean 'localsgd'?); "
                                      "choose one of dense,"),
    (["train", "--threads", "0"], "argument --threads: a whole number >= 1, not 0"),
    (["train", "--dataset", "digits", "--epochs", "0"], "--epochs must be a finite number > 0, got 0.0"),
    (["train", "--dataset", "digits", "--local-steps", "0"], "--local-steps must be an integer >= 1, got 0"),
    (["train", "--dataset", "digits", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["train", "--dataset", "digits", "--model", "resnet19"], "unknown model 'resnet19' (did you mean 'resnet18'?)"),
    (["compare", "--dataset", "digits", "--methods", "prunex,foo,locsgd"],
     "--methods: unknown method 'foo'; unknown method 'locsgd' (did you mean 'localsgd'?); it takes"),
])
def test_a_bad_value_is_refused_naming_the_flag_and_the_closest_choice(argv, said, capsys, tmp_path):
    """Refused before anything runs, by the flag the user typed (not a Python field), with a "did you mean"
    where a choice is close."""
    from prunex_hvd.app import cli
    capsys.readouterr()
    try:
        code = cli.main([*argv, "--out", str(tmp_path / "run")])
    except SystemExit as exit_:   # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and said in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, said", [
    (["--method", "localsgd", "--rho1", "0.1"], "--rho1 does not apply to --method localsgd: only to prunex, "
                                                "prunex-flat"),
    (["--method", "dense", "--sparsity", "channel:0.5"], "--sparsity does not apply to --method dense: only to "
                                                         "prunex, prunex-flat, pactrain"),
    (["--method", "prunex-flat", "--payload-dtype", "bf16"], "--payload-dtype does not apply to --method prunex-flat"),
    (["--method", "diloco", "--topk-ratio", "0.1"], "--topk-ratio does not apply to --method diloco: only to topk"),
    (["--method", "prunex", "--hier-intra-steps", "2"], "--hier-intra-steps does not apply to --method prunex"),
])
def test_a_flag_of_another_method_is_refused_by_name(argv, said, capsys, tmp_path):
    from prunex_hvd.app import cli
    capsys.readouterr()
    assert cli.main(["train", *argv, "--out", str(tmp_path / "run")]) == 2
    assert said in capsys.readouterr().err


def test_a_method_s_own_flags_and_a_config_file_s_settings_are_taken(tmp_path):
    """Each method takes its own flags; a --config file (a run's config.json holds every setting) is not checked."""
    assert _train_config("--method", "topk", "--topk-ratio", "0.1").topk_ratio == 0.1
    assert _train_config("--method", "pactrain", "--sparsity", "channel:0.25").consensus.sparsity == "channel:0.25"
    assert _train_config("--method", "prunex-flat", "--rho1", "0.02").consensus.rho1 == 0.02
    settings = tmp_path / "settings.json"
    settings.write_text('{"rho1": 0.02, "topk_ratio": 0.5}')
    assert _train_config("--method", "localsgd", "--config", str(settings)).topk_ratio == 0.5


def test_the_method_of_a_config_file_decides_which_flags_apply(tmp_path, capsys):
    """A run's config.json names its method: that method's flags are taken on top, another's refused by name."""
    from prunex_hvd.app import cli
    settings = tmp_path / "topk.json"
    settings.write_text('{"method": "topk", "topk_ratio": 0.5}')
    assert _train_config("--config", str(settings), "--topk-ratio", "0.1").topk_ratio == 0.1
    capsys.readouterr()
    assert cli.main(["train", "--config", str(settings), "--rho1", "0.1", "--out", str(tmp_path / "run")]) == 2
    assert "--rho1 does not apply to --method topk" in capsys.readouterr().err


def test_compare_takes_methods_only(capsys):
    """compare has one way to say which methods: ``--methods`` (``--method X`` is read as its prefix)."""
    from prunex_hvd.app import cli
    code, out, _ = _exits(["compare", "--help"], capsys)
    assert code == 0 and "--methods METHODS" in out and "--method METHOD" not in out
    assert cli.parse(["compare", "--method", "dense"]).methods == "dense"


def test_plain_train_runs_on_the_embedded_digits():
    """``prunex-hvd train`` with no flags needs no download and no --data-dir."""
    cfg = _train_config()
    assert (cfg.dataset, cfg.data_dir) == ("digits", None)
    from prunex_hvd.app.data import load_dataset
    assert len(load_dataset(cfg.dataset, data_dir=cfg.data_dir).test_y) == 360


def test_a_setting_from_a_config_file_keeps_its_json_key(tmp_path, capsys):
    from prunex_hvd.app import cli
    settings = tmp_path / "settings.json"
    settings.write_text('{"local_steps": 0}')
    capsys.readouterr()
    assert cli.main(["train", "--dataset", "digits", "--config", str(settings), "--out", str(tmp_path / "r")]) == 2
    assert "local_steps must be an integer >= 1, got 0" in capsys.readouterr().err


def test_version(capsys):
    import prunex_hvd
    code, out, _ = _exits(["--version"], capsys)
    assert code == 0 and out.strip() == f"prunex-hvd {prunex_hvd.__version__}"
    proc = subprocess.run([str(BIN / "prunex-hvd"), "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"prunex-hvd {prunex_hvd.__version__}"


@pytest.mark.parametrize("argv,knob", [
    (["--relaxation", "1.6"], "relaxation"), (["--keep-ramp-rounds", "2"], "keep_ramp_rounds"),
    (["--sync-rounds", "1"], "sync_rounds"), (["--retrain", "average"], "retrain"),
    (["--no-masked-retrain"], "masked_retrain"), (["--overlap-steps", "2"], "overlap_steps"),
    (["--outer-momentum=0.5"], "acceleration"), (["--budget-floor", "0.2"], "budget_floor"),
])
def test_a_removed_knobs_flag_exits_2_naming_the_log_entry(argv, knob, capsys):
    flag = argv[0].split("=")[0]
    for command in ("train", "compare"):
        code, _, err = _exits([command, "--epochs", "1", *argv], capsys)
        assert code == 2
        assert err == f"prunex-hvd: error: {flag} was removed: the measurements did not earn it a place " \
                      f"(benchmarks/log/removed-knobs.md, '{knob}', says what it did and the commit to bring it " \
                      f"back from)\n"


def test_every_removed_flag_names_an_entry_of_the_log():
    from prunex_hvd.app import cli
    log = (REPO / "benchmarks" / "log" / "removed-knobs.md").read_text()
    assert {entry for entry in cli.REMOVED_FLAGS.values() if f"\n## {entry}\n" not in log} == set()


@pytest.mark.parametrize("argv,name", [(["--restart", "none"], "restart"), (["--no-adaptive-rho"], "adaptive_rho"),
                                       (["--bucket-mb", "2"], "bucket_mb"), (["--no-progress"], "progress"),
                                       (["--freeze-patience=5"], "freeze_patience")])
def test_a_config_only_setting_exits_2_saying_to_use_config(argv, name, capsys):
    code, _, err = _exits(["train", *argv], capsys)
    assert code == 2
    assert err.startswith(f"prunex-hvd: error: {argv[0].split('=')[0]} is not a flag: set {name!r} in a --config "
                          f"JSON file"), err


def test_coupled_streams_is_now_a_value_of_coupled(capsys):
    code, _, err = _exits(["train", "--coupled-streams"], capsys)
    assert code == 2 and err == "prunex-hvd: error: --coupled-streams is now --coupled streams\n"
    assert _train_config("--coupled", "streams").consensus.coupled == "streams"


def test_config_takes_a_runs_config_json_or_plain_settings_and_the_flags_go_over_it(tmp_path):
    from prunex_hvd.app.train import TrainConfig
    from prunex_hvd.engine.config import ConsensusConfig
    run = TrainConfig.from_flat(rho1=0.3, rho2=0.004, restart="none", bucket_mb=2.0, lr=0.1, local_steps=7,
                                nesterov=True, epochs=3, out=str(tmp_path / "old"), resume=True)
    written = tmp_path / "config.json"
    written.write_text(json.dumps({"config": run.as_dict(), "meta": {"model": run.model}, "threads_per_rank": 1}))
    got = _train_config("--config", str(written))
    assert got == TrainConfig.from_flat(**dict(run.as_dict(), out=TrainConfig.out, resume=False))   # where and
    # whether to resume are this launch's own
    over = _train_config("--config", str(written), "--rho1", "0.5", "--lr=0.2", "--epochs", "4")
    assert (over.consensus.rho1, over.lr, over.epochs) == (0.5, 0.2, 4.0)
    assert (over.consensus.rho2, over.consensus.restart, over.consensus.local_steps, over.nesterov) == \
        (0.004, "none", 7, True)   # what no flag on the command line gave stays the file's
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"restart": "none", "adaptive_rho": False, "bucket_mb": 2, "augment": "none",
                                 "diloco_outer_lr": 0.5}))
    got = _train_config("--config", str(plain), "--rho2", "0.003")
    assert got.consensus == ConsensusConfig(restart="none", adaptive_rho=False, bucket_mb=2, rho2=0.003)
    assert (got.augment, got.diloco_outer_lr) == ("none", 0.5)
    assert _train_config("--config", str(plain), "--paper").consensus == \
        ConsensusConfig.paper(restart="none", adaptive_rho=False, bucket_mb=2)


@pytest.mark.parametrize("settings,message", [
    ({"rho": 0.1}, r"'rho' is not a setting of prunex-hvd train"),
    ({"rho1": 0.1, "relaxation": 1.5}, r"relaxation 1\.5 was removed \(benchmarks/log/removed-knobs\.md, 'relaxation'\)"),
    ({"config": {"retrain": "average"}}, r"retrain 'average' was removed \(benchmarks/log/removed-knobs\.md, 'retrain'\)"),
    ([1, 2], r"expected a JSON object of settings, got list"),
])
def test_config_refuses_a_setting_it_does_not_have(tmp_path, settings, message):
    path = tmp_path / "settings.json"
    path.write_text(json.dumps(settings))
    with pytest.raises(ValueError, match=rf"^--config {re.escape(str(path))}: {message}"):
        _train_config("--config", str(path))
    with pytest.raises(ValueError, match=r"^--config .*missing\.json: "):
        _train_config("--config", str(tmp_path / "missing.json"))


def test_config_reads_an_earlier_versions_config_json_where_its_removed_knobs_were_off(tmp_path):
    """A run's config.json from before the removals holds every removed knob: at their off values they mean
    nothing and are dropped, and round_pull (the lr's cap on rho) is rho_max="auto" now; on, they are refused."""
    from prunex_hvd.app.train import REMOVED_OFF, TrainConfig
    old = dict(REMOVED_OFF, outer_momentum=0.5, rho1=0.01, rho2=0.001, rho_max=10.0, restart="global",
               payload_dtype="bf16", lr=0.05, epochs=3)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"config": old}))
    got = _train_config("--config", str(path))
    assert got.consensus.rho_max == "auto" and (got.lr, got.epochs) == (0.05, 3.0)
    assert got == TrainConfig.from_flat(rho1=0.01, rho2=0.001, rho_max="auto", restart="global",
                                        payload_dtype="bf16", lr=0.05, epochs=3)
    path.write_text(json.dumps({"config": dict(old, round_pull=None, rho_max=0.5)}))
    assert _train_config("--config", str(path)).consensus.rho_max == 0.5   # a number asked for
    path.write_text(json.dumps({"config": dict(old, sync_rounds=2)}))
    with pytest.raises(ValueError, match=r"sync_rounds 2 was removed \(benchmarks/log/removed-knobs\.md, "
                                         r"'sync_rounds'\)"):
        _train_config("--config", str(path))
