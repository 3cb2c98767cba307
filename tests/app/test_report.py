"""``prunex-hvd report``: fake runs in the trainer's format → figures and a markdown table."""
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from prunex_hvd.app import report

LAYERS = ["conv1.weight", "conv2.weight", "conv3.weight"]
PNG = b"\x89PNG\r\n\x1a\n"
MIB = 2**20   # the report's MB


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.conv3 = nn.Conv2d(16, 16, 1)
        self.fc = nn.Linear(16, 10)


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _admm_run(root: Path) -> Path:
    """A complete H-SADMM run: per-layer data, summary.json and a structurally sparse final_model.pt."""
    d = root / "prunex"
    d.mkdir()
    rounds = []
    for i in range(4):
        rounds.append({
            "event": "round", "round": i + 1, "epoch": float(i + 1), "step": 100 * (i + 1), "wall_s": 12.5 * (i + 1),
            "train_loss": 2.0 - 0.3 * i, "train_acc": 0.4 + 0.1 * i,
            "test_acc": None if i == 1 else 0.5 + 0.1 * i, "test_loss": 1.5 - 0.2 * i,
            "inter_bytes": MIB // 4 * (i + 1), "intra_bytes": 900_000 * (i + 1),
            "dense_inter_bytes": MIB * (i + 1), "density": 0.5,
            "layer_density": {name: 0.5 for name in LAYERS},
            "residuals": {name: {"r_intra": 0.5 / (i + 1) / (j + 1), "s_intra": 0.01, "r_inter": 0.2 / (i + 1) ** 2,
                                 "s_inter": 0.02} for j, name in enumerate(LAYERS)},
            "rho": {name: {"rho1": 1.5e-3, "rho2": 1.5e-4} for name in LAYERS},
            "mask_drift": 0.1 / (i + 1), "frozen": i == 3, "method": "hsadmm"})
    final = {"event": "final", "method": "hsadmm", "round": 4, "step": 400, "epoch": 4.0, "wall_s": 51.0,
             "test_acc": 0.8765, "test_loss": 0.7, "inter_bytes": MIB, "intra_bytes": 3_600_000,
             "dense_inter_bytes": 4 * MIB, "density": 0.5, "layer_density": {name: 0.5 for name in LAYERS}}
    _write_jsonl(d / "metrics.jsonl", rounds + [final])
    (d / "summary.json").write_text(json.dumps({
        "name": "prunex", "method": "prunex", "model": "tinynet", "dataset": "cifar10", "sparsity": "channel:0.5",
        "world_size": 4, "num_nodes": 2, "ranks_per_node": 2, "epochs": 4, "rounds": 4, "steps": 400,
        "final_test_acc": 0.8765, "final_test_loss": 0.7, "density": 0.5,
        "layer_density": {"conv1.weight": 0.667, "conv2.weight": 0.5, "conv3.weight": 0.5},
        "inter_bytes": MIB, "intra_bytes": 3_600_000, "dense_inter_bytes": 4 * MIB, "wall_s": 51.0,
        "params_total": 2000, "params_nonzero": 1000, "args": {"lr": 0.1}}))
    model = TinyNet()
    with torch.no_grad():
        model.conv1.weight[::2] = 0            # pruned output filters (rows)
        model.conv2.weight[:, 1::2] = 0        # pruned input channels (column blocks)
        model.conv3.weight[3:9] = 0
    torch.save({"model": "tinynet", "state_dict": model.state_dict(), "sparsity": "channel:0.5",
                "num_classes": 10, "in_channels": 3}, d / "final_model.pt")
    return d


def _baseline_run(root: Path) -> Path:
    """An interrupted dense baseline: no per-layer data, no summary.json, no final record, no model."""
    d = root / "baseline"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"config": {"model": "resnet18", "dataset": "cifar10",
                                                          "method": "allreduce", "sparsity": "None"}}))
    _write_jsonl(d / "metrics.jsonl", [
        {"event": "round", "round": i + 1, "epoch": float(i + 1), "step": 100 * (i + 1), "wall_s": 10.0 * (i + 1),
         "train_loss": 1.9 - 0.3 * i, "train_acc": 0.45 + 0.1 * i, "test_acc": None if i == 2 else 0.6123 + 0.05 * i,
         "test_loss": None, "inter_bytes": 4 * MIB * (i + 1), "intra_bytes": 0,
         "dense_inter_bytes": 4 * MIB * (i + 1), "density": 1.0, "mask_drift": None, "frozen": False,
         "method": "allreduce"} for i in range(3)])
    return d


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return _admm_run(root), _baseline_run(root)


def _dense_run(root: Path) -> Path:
    """A complete measured dense run (method ``dense``): 8 MiB across nodes, its counterfactual the same."""
    d = root / "dense"
    d.mkdir()
    _write_jsonl(d / "metrics.jsonl", [
        {"event": "round", "method": "dense", "round": i + 1, "epoch": float(i + 1), "wall_s": 9.0 * (i + 1),
         "train_loss": 1.8 - 0.4 * i, "test_loss": 1.4 - 0.3 * i, "test_acc": 0.6 + 0.1 * i,
         "inter_bytes": 2 * MIB * (i + 1), "dense_inter_bytes": 2 * MIB * (i + 1), "density": 1.0}
        for i in range(4)])
    (d / "summary.json").write_text(json.dumps({
        "method": "dense", "model": "tinynet", "dataset": "cifar10", "sparsity": "channel:0.5", "world_size": 4,
        "num_nodes": 2, "ranks_per_node": 2, "final_test_acc": 0.9012, "density": 1.0, "inter_bytes": 8 * MIB,
        "dense_inter_bytes": 8 * MIB, "wall_s": 36.0}))
    return d


def _keeping_figures(figs: dict):
    """A stand-in for the report's ``_save`` that also keeps each figure in ``figs`` by its file stem."""
    save = report._save

    def keep(fig, path, tight=True):
        out = save(fig, path, tight)
        figs[Path(path).stem] = fig
        return out
    return keep


def _report_drawn(run_dirs, out_dir, **kw) -> dict:
    """``make_report``'s answer, with ``"drawn"``: {figure stem: matplotlib Figure} of what it saved."""
    figs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report, "_save", _keeping_figures(figs))
        res = report.make_report([str(d) for d in run_dirs], out_dir=str(out_dir), **kw)
    return dict(res, drawn=figs)


@pytest.fixture(scope="module")
def made(runs, tmp_path_factory):
    return _report_drawn(runs, tmp_path_factory.mktemp("out"))


@pytest.fixture(scope="module")
def with_dense(runs, tmp_path_factory):
    """PruneX beside a measured dense run."""
    root = tmp_path_factory.mktemp("with_dense")
    return _report_drawn([runs[0], _dense_run(root)], root / "rep", max_mask_layers=0)


def _valid_png(path):
    data = Path(path).read_bytes()
    return data.startswith(PNG) and len(data) > 5000


def test_load_run_complete_and_incomplete(runs):
    a, b = (report.load_run(p) for p in runs)
    assert (a["name"], a["complete"], len(a["metrics"])) == ("prunex", True, 4)
    assert a["final"]["test_acc"] == 0.8765 and a["summary"]["model"] == "tinynet"
    assert (b["name"], b["complete"], b["summary"], b["final"]) == ("baseline", False, None, None)


def test_every_figure_written_and_valid(made):
    expected = {"accuracy_vs_epoch", "loss_vs_epoch", "accuracy_vs_time", "accuracy_vs_inter_bytes", "residuals",
                "density_per_layer", "communication", "masks_prunex"}
    assert set(made["figures"]) == expected
    for key, path in made["figures"].items():
        assert Path(path).name == f"{key}.png" and Path(path).parent == Path(made["out_dir"])
        assert _valid_png(path), path
    assert not (Path(made["out_dir"]) / "masks_baseline.png").exists()


def test_table_numbers_and_links(made):
    md = Path(made["table"]).read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip().strip("|").split("|")]
            for line in md.splitlines() if line.startswith("| prunex") or line.startswith("| baseline")}
    a, b = rows["prunex"], rows["baseline (incomplete)"]
    # run, method, model, dataset, sparsity, ranks, acc %, density, inter MB, counterfactual MB, ratio, wall s
    assert a == ["prunex", "prunex", "tinynet", "cifar10", "channel:0.5", "2×2", "87.65", "0.500", "1.00", "4.00",
                 "0.250", "51.0"]
    assert "| × dense run |" not in md and "Against the measured dense run" not in md   # no dense run among these
    assert made["summary"] == []
    assert b[1:4] == ["allreduce", "resnet18", "cifar10"]   # setup from config.json: no summary.json
    assert b[6] == "66.23"                                     # the last round had no eval: skipped
    assert b[8:11] == ["12.00", "12.00", "1.000"] and b[11] == "30.0"
    for path in made["figures"].values():
        assert f"]({Path(path).name})" in md


def test_figures_without_data_are_skipped(runs, tmp_path):
    res = report.make_report([str(runs[1])], out_dir=str(tmp_path))
    assert set(res["figures"]) == {"accuracy_vs_epoch", "loss_vs_epoch", "accuracy_vs_time",
                                   "accuracy_vs_inter_bytes", "communication"}   # (its training loss only)
    for skipped in ("residuals", "density_per_layer", "masks_baseline"):
        assert not (tmp_path / f"{skipped}.png").exists()
        assert f"{skipped}.png" not in (tmp_path / "report.md").read_text()


def test_main_writes_files(runs, tmp_path, capsys):
    out = tmp_path / "rep"
    assert report.main([str(runs[0]), str(runs[1]), "--out", str(out), "--mask-layers", "2"]) == 0
    printed = capsys.readouterr().out.split()
    assert str(out / "report.md") in printed and str(out / "masks_prunex.png") in printed
    assert all(Path(p).is_file() for p in printed)   # the paths only: no dense run, no comparison


def test_main_prints_the_comparison_with_the_dense_run(runs, tmp_path, capsys):
    dense = _dense_run(tmp_path)
    assert report.main([str(runs[0]), str(dense), "--out", str(tmp_path / "rep"), "--mask-layers", "0"]) == 0
    paths, words = capsys.readouterr().out.split("\n\n", 1)
    assert all(Path(p).is_file() for p in paths.split())
    assert words.startswith("against the measured dense run")
    assert "dense (measured reference" in words and "90.12%" in words                 # its accuracy
    assert "prunex: final test accuracy 87.65%" in words and "1.00 MB across nodes = 0.125x the dense run's " \
                                                             "measured 8.00 MB" in words


def test_main_default_out_dir(tmp_path):
    run = _baseline_run(tmp_path)
    assert report.main([str(run)]) == 0
    assert (tmp_path / "report" / "report.md").is_file()


def test_mask_layers_spread_over_depth():
    assert report._spread(list(range(10)), 4) == [0, 3, 6, 9]
    assert report._spread([1, 2], 4) == [1, 2]


def test_bad_paths_raise(tmp_path, capsys):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="nope.*not a directory"):
        report.load_run(missing)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="file.txt"):
        report.make_report([str(a_file)])
    no_metrics = tmp_path / "empty_dir"
    no_metrics.mkdir()
    with pytest.raises(ValueError, match="empty_dir.*metrics.jsonl"):
        report.load_run(no_metrics)
    empty = tmp_path / "empty_metrics"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty_metrics.*no round records"):
        report.load_run(empty)
    assert report.main([str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_torn_last_line_is_tolerated(tmp_path):
    d = _baseline_run(tmp_path)
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"event": "round", "round": 4, "wall')
    assert len(report.load_run(d)["metrics"]) == 3


def _seed_run(root: Path, name: str, accs, final=None) -> Path:
    """A run as bench_learning writes it (``VARIANT-sSEED``): one round per epoch with these accuracies."""
    d = root / name
    d.mkdir()
    recs = [{"event": "round", "round": i + 1, "epoch": float(i + 1), "wall_s": 2.0 * (i + 1), "test_acc": a,
             "inter_bytes": 1000 * (i + 1)} for i, a in enumerate(accs)]
    if final is not None:
        recs.append({"event": "final", "epoch": float(len(accs)), "wall_s": 2.0 * len(accs), "test_acc": final})
    _write_jsonl(d / "metrics.jsonl", recs)
    return d


@pytest.fixture()
def seeded(tmp_path):
    root = tmp_path / "task"
    root.mkdir()
    return [_seed_run(root, "localsgd-s0", [0.5, 0.91, 0.96], 0.96),
            _seed_run(root, "localsgd-s1", [0.6, 0.85, 0.93], 0.94),
            _seed_run(root, "prunex-s0", [0.1, None, 0.92], 0.95),
            _seed_run(root, "prunex-s1", [0.2, 0.5, 0.8], 0.81)]


def test_seeds_are_one_variant_and_epochs_to_target(seeded):
    runs = [report.load_run(p) for p in seeded]
    assert [report.variant_of(r) for r in runs] == ["localsgd", "localsgd", "prunex", "prunex"]
    assert [report.epochs_to_target(r, 0.9) for r in runs] == [2.0, 3.0, 3.0, None]   # None: never evaluated there
    assert report.epochs_to_target(runs[2], 0.05) == 1.0
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip().strip("|").split("|")]
            for line in report.target_table(runs, [0.9, 0.95]).splitlines()[2:]}
    # mean over the seeds that reached it, "(k/n)" when some did not; the final accuracy's mean and range
    assert rows["localsgd"] == ["localsgd", "2", "2.5", "3.0 (1/2)", "95.00 (94.00–96.00)"]
    assert rows["prunex"] == ["prunex", "2", "3.0 (1/2)", "never", "88.00 (81.00–95.00)"]


def test_epoch_figures_and_target_table(seeded, tmp_path):
    res = report.make_report([str(p) for p in seeded], out_dir=str(tmp_path / "rep"), targets=[0.95, 0.9])
    assert {"accuracy_vs_epoch", "epochs_to_target"} <= set(res["figures"])
    assert "loss_vs_epoch" not in res["figures"]   # these runs recorded no loss
    for key in ("accuracy_vs_epoch", "epochs_to_target"):
        assert _valid_png(res["figures"][key])
    md = Path(res["table"]).read_text()
    assert "## Epochs to target" in md and "| epochs to 90% | epochs to 95% |" in md   # targets sorted
    assert "| prunex | 2 | 3.0 (1/2) | never |" in md
    without = report.make_report([str(p) for p in seeded], out_dir=str(tmp_path / "plain"))
    assert "epochs_to_target" not in without["figures"] and "Epochs to target" not in Path(without["table"]).read_text()


def test_targets_on_the_command_line(seeded, tmp_path, capsys):
    from prunex_hvd.app import cli
    out = tmp_path / "rep"
    assert cli.main(["report", *map(str, seeded), "--out", str(out), "--targets", "0.9,0.95"]) == 0
    assert (out / "epochs_to_target.png").is_file()
    for bad in ("95", "0.9,x", ""):
        with pytest.raises(SystemExit):
            report.main([str(seeded[0]), "--targets", bad])
        assert "--targets" in capsys.readouterr().err
    with pytest.raises(ValueError, match="targets must be accuracies"):
        report.make_report([str(seeded[0])], out_dir=str(tmp_path / "x"), targets=[1.5])


def test_racks_add_the_spine_residual_column(tmp_path):
    """Three tiers report r_spine: the residuals figure gains a third column (two without racks)."""
    import matplotlib.image
    widths = {}
    for racks in (False, True):
        root = tmp_path / str(racks)
        root.mkdir()
        d = _admm_run(root)
        if racks:
            recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
            for rec in recs:
                for res in (rec.get("residuals") or {}).values():
                    res.update(r_spine=0.05, s_spine=0.01)
            _write_jsonl(d / "metrics.jsonl", recs)
        path = report._fig_residuals([report.load_run(d)], tmp_path / f"residuals-{racks}.png")
        widths[racks] = matplotlib.image.imread(path).shape[1]
    assert 1.4 < widths[True] / widths[False] < 1.6


def _bar_notes(fig) -> list:
    """The bold notes over the measured bars of the communication figure."""
    return [t.get_text() for t in fig.axes[0].texts if t.get_fontweight() == "bold"]


def _legend_texts(fig) -> list:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


def _table(md: str):
    """(column names, {run: cells}) of report.md's run table."""
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    head = next(line for line in lines if line.startswith("| run |"))
    cols = [c.strip() for c in head.strip().strip("|").split("|")]
    rows = {}
    for line in lines[lines.index(head) + 1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells
    return cols, rows


def test_measured_dense_run_is_the_reference(with_dense):
    md = Path(with_dense["table"]).read_text()
    cols, rows = _table(md)
    at = cols.index("× dense run")
    assert cols[at - 1] == "inter-node MB"
    assert rows["prunex"][at] == "0.125" and rows["dense"][at] == "1.000"       # 1 MiB / 8 MiB measured
    assert rows["prunex"][cols.index("× counterfactual")] == "0.250"            # its own counterfactual
    assert rows["dense"][cols.index("sparsity")] == "none"                      # dense prunes nothing
    summary = with_dense["summary"]
    assert summary[0].startswith("dense (measured reference") and "90.12%" in summary[0]
    assert "87.65%" in summary[1] and "0.125x the dense run's measured 8.00 MB" in summary[1]
    assert "Against the measured dense run" in md and "0.125x the dense run" in md
    # the dense run's bar is measured only (no counterfactual bar beside it); ratios are to it
    comm = with_dense["drawn"]["communication"]
    assert _bar_notes(comm) == ["1 MB\n0.12× dense run", "8 MB\nthe reference"]
    assert len([b for b in comm.axes[0].patches if b.get_hatch()]) == 1         # prunex's counterfactual only
    curves = _legend_texts(with_dense["drawn"]["accuracy_vs_inter_bytes"])
    assert curves == ["prunex", "dense", f"{report.COUNTERFACTUAL}\n(in its run's colour)",
                      "final model (after finalize)"]            # no counterfactual curve for the dense run
    styles = [line.get_linestyle() for line in with_dense["drawn"]["accuracy_vs_inter_bytes"].axes[0].get_lines()]
    assert styles.count("--") == 2                                # prunex's counterfactual and its legend entry


def test_counterfactual_is_labelled_and_defined(made):
    md = Path(made["table"]).read_text()
    cols, _ = _table(md)
    assert "counterfactual MB (dense, never sent)" in cols
    terms = md.split("## Terms", 1)[1].split("\n## ", 1)[0]
    for term in ("Inter-node bytes", "Dense run", "Counterfactual", "Density", "Ratio", "Final model"):
        assert f"**{term}**" in terms, term
    assert report.COUNTERFACTUAL in terms and report.COUNTERFACTUAL_STEPS in terms   # both kinds defined
    assert "dense-equivalent" in terms and "recalibrated" in terms and "byte ledger" in terms
    comm = made["drawn"]["communication"]
    legend = _legend_texts(comm)
    # two kinds of counterfactual in one legend entry (prunex's rounds, an unknown method's): the generic label
    assert f"{report.COUNTERFACTUAL_ANY}\n(never sent)" in legend and any(t.startswith("measured") for t in legend)
    assert _bar_notes(comm) == ["1 MB\n0.250× counterfactual", "12 MB\n1.000× counterfactual"]   # to their own
    # and over each hatched bar what it counts, the kinds differing
    assert [t.get_text() for t in comm.axes[0].texts if t.get_fontweight() != "bold"] == [
        "these rounds\nsent dense", "a dense exchange"]
    curves = _legend_texts(made["drawn"]["accuracy_vs_inter_bytes"])
    # prunex's, dashed; the baseline's counterfactual is its measured curve: not drawn twice
    assert [t for t in curves if "counterfactual" in t] == [f"{report.COUNTERFACTUAL}\n(in its run's colour)"]


def test_every_figure_has_a_caption(made):
    lines = Path(made["table"]).read_text().splitlines()
    for key, path in made["figures"].items():
        at = lines.index(next(line for line in lines if line.endswith(f"]({Path(path).name})")))
        caption = lines[at + 2]
        assert caption.startswith("*") and caption.endswith("*") and len(caption) > 40, (key, caption)
        if key in report.FIGURES:
            assert caption == f"*{report.FIGURES[key][1]}*"


def test_loss_figure_draws_test_and_training_loss(made):
    assert _valid_png(made["figures"]["loss_vs_epoch"]) and "loss_vs_epoch.png" in Path(made["table"]).read_text()
    fig = made["drawn"]["loss_vs_epoch"]
    # prunex: test (solid) and training (dashed); the baseline recorded training loss only
    assert sorted(line.get_linestyle() for line in fig.axes[0].get_lines()) == ["-", "--", "--"]
    assert _legend_texts(fig) == ["prunex", "baseline", "test loss (solid)", "training loss (dashed)"]


def test_legends_never_cover_an_axes(made, with_dense):
    drawn = list(made["drawn"].items()) + list(with_dense["drawn"].items())
    assert {"residuals", "density_per_layer", "communication", "loss_vs_epoch"} <= {k for k, _ in drawn}
    for key, fig in drawn:
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
        for legend in legends:
            box = legend.get_window_extent()
            for ax in fig.axes:
                assert not box.overlaps(ax.get_window_extent()), key


def test_residual_legend_names_the_layers(made):
    fig = made["drawn"]["residuals"]
    legend = fig.axes[-1].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["conv1", "conv2", "conv3"]
    assert "all 3" in legend.get_title().get_text()
    lines = fig.axes[0].get_lines()
    assert len({(str(line.get_color()), line.get_linestyle()) for line in lines}) == 3   # told apart


def test_residuals_of_many_layers_show_ten_spread_over_depth(tmp_path, monkeypatch):
    names = [f"layer{i}.conv.weight" for i in range(20)]
    d = tmp_path / "deep"
    d.mkdir()
    _write_jsonl(d / "metrics.jsonl", [
        {"event": "round", "round": r, "epoch": float(r), "test_acc": 0.5, "layer_density": {n: 0.5 for n in names},
         "residuals": {n: {"r_intra": 0.1 / r / (j + 1), "r_inter": 0.05 / r} for j, n in enumerate(names)}}
        for r in (1, 2, 3)])
    figs = {}
    monkeypatch.setattr(report, "_save", _keeping_figures(figs))
    report._fig_residuals([report.load_run(d)], tmp_path / "residuals.png")
    legend = figs["residuals"].axes[-1].get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert len(labels) == 10 and labels[0] == "layer0.conv" and labels[-1] == "layer19.conv"
    assert "10 of 20, spread over depth" in legend.get_title().get_text()
    assert len(figs["residuals"].axes[0].get_lines()) == 10


def test_counterfactual_label_says_what_was_counted():
    def run(method):
        return {"summary": {"method": method}, "final": None, "metrics": [], "config": None}
    assert report.COUNTERFACTUAL == "counterfactual: these rounds sent dense"
    assert report.counterfactual_label(run("prunex")) == report.COUNTERFACTUAL
    assert report.counterfactual_label(run("prunex-flat")) == report.COUNTERFACTUAL
    for baseline in ("localsgd", "topk", "diloco", "pactrain"):   # dense_inter_bytes: a dense allreduce each step
        assert report.counterfactual_label(run(baseline)) == report.COUNTERFACTUAL_STEPS
    assert report.counterfactual_label(run("something-else")) == report.COUNTERFACTUAL_ANY
