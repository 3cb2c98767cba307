"""``prunex-hvd report RUN [RUN ...]``: training runs → PNG figures and a markdown table.

    prunex-hvd report runs/A runs/B [--out DIR] [--mask-layers N] [--targets 0.9,0.95]

A run is a directory written by the trainer: ``metrics.jsonl`` (``"event": "round"`` lines, then one
``"event": "final"``), ``summary.json`` (missing when the run was interrupted; the run is then shown as
"(incomplete)" and its numbers come from the last metrics line) and, optionally, ``final_model.pt``.

Written to ``DIR`` (default ``<parent of the first run>/report``), each only when some run has the data:

* ``accuracy_vs_epoch.png``        test accuracy vs epoch: accuracy at equal epochs, whatever the link
* ``loss_vs_epoch.png``            test loss (solid) and training loss (dashed) vs epoch
* ``epochs_to_target.png``         first epoch reaching each ``--targets`` accuracy (only with ``--targets``)
* ``accuracy_vs_time.png``         test accuracy vs cumulative training wall time
* ``accuracy_vs_inter_bytes.png``  test accuracy vs cumulative inter-node MB (and the counterfactual's MB)
* ``residuals.png``                per-layer primal residuals r_intra / r_inter (and r_spine with racks) over rounds
* ``density_per_layer.png``        final density of each conv layer
* ``masks_<run>.png``              |W| of some pruned conv layers in the GEMM view, pruned entries white
* ``communication.png``            final inter-node MB, measured, beside the counterfactual MB
* ``report.md``                    one table row per run, the terms, then the figures with a caption each

Two references for the bytes. A *measured dense run* is a run of method ``dense`` (a gradient allreduce every
step) in the same set: when there is one, the table gives every run's bytes as a ratio to it (``× dense run``)
and :func:`summary_lines` says it in words. The *counterfactual* is what the trainer writes as
``dense_inter_bytes``, computed and never sent: for PruneX its consensus rounds had each sent the whole model
dense, for the other methods a dense gradient allreduce every step (:func:`counterfactual_label`); it is
labelled so wherever it is drawn.

MB here is 2^20 bytes, as in the trainer's and ``prunex-hvd info``'s output. Figures share one colour per
run; labels are the run folder names. Runs whose folders differ only in a seed suffix (``localsgd-s0``,
``localsgd-s1``: what ``benchmarks/bench_learning.py`` writes) are one *variant* in the two epoch figures and
the epochs-to-target table: the mean over seeds as a line, the seeds' range as a band.

    from prunex_hvd.app.report import make_report
    out = make_report(["runs/A", "runs/B"], targets=[0.95])   # {"out_dir", "figures", "table", "summary"}
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Optional

MB = 2**20   # the unit the trainer prints, so the table and the training log agree
DPI = 120
RESIDUALS = (("r_intra", "intra-node primal residual"), ("r_inter", "inter-node primal residual"),
             ("r_spine", "between-rack primal residual"))   # the last only with racks (three tiers)
_RESIDUAL_MAX_LAYERS = 10   # lines per residual panel: more cannot be told apart, even by colour and style
_LINE_STYLES = ("-", "--", ":", "-.")
_CURVES = (9.5, 4.5)   # inches: a plot of curves and its legend beside it
# what a run's dense_inter_bytes stands for, in the label it carries wherever it shows: PruneX's consensus rounds
# had they sent the whole model dense; for the other methods, a dense gradient allreduce every step
COUNTERFACTUAL = "counterfactual: these rounds sent dense"
COUNTERFACTUAL_STEPS = "counterfactual: a dense allreduce every step"
COUNTERFACTUAL_ANY = "counterfactual: a dense exchange"   # a method this version does not know
_COUNTERFACTUAL_STYLES = {COUNTERFACTUAL: "--", COUNTERFACTUAL_STEPS: ":", COUNTERFACTUAL_ANY: "-."}
DENSE_METHOD = "dense"   # the measured reference: a gradient allreduce every step
_CONFIG_KEYS = ("method", "model", "dataset", "sparsity")   # what config.json may supply for a torn run


# ------------------------------------------------------------------------------------------------ loading

def load_run(path) -> dict:
    """Read one run directory.

    Returns ``{"name", "dir", "metrics": [round dicts], "final": dict|None, "summary": dict|None,
    "complete": bool, "config": dict|None}``; ``complete`` is whether ``summary.json`` was written;
    ``config`` is the trainer's ``config.json`` ``"config"`` (setup of a run that never wrote a summary).
    Raises ValueError when ``path`` is not a directory holding ``metrics.jsonl`` or that has no round records.
    """
    d = Path(path)
    if not d.is_dir():
        raise ValueError(f"{path}: not a directory; expected a run directory containing metrics.jsonl")
    mfile = d / "metrics.jsonl"
    if not mfile.is_file():
        raise ValueError(f"{path}: no metrics.jsonl; expected a run directory written by the trainer")
    lines = [(i, ln) for i, ln in enumerate(mfile.read_text().splitlines(), 1) if ln.strip()]
    metrics, final = [], None
    for pos, (lineno, line) in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if pos == len(lines) - 1:   # a run killed mid-write leaves half a last line: keep the rest
                continue
            raise ValueError(f"{mfile}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{mfile}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        event = rec.get("event", "round")
        if event == "final":
            final = rec
        elif event == "round":
            metrics.append(rec)
    if not metrics:
        raise ValueError(f"{mfile}: no round records (lines with \"event\": \"round\"); is the run empty?")
    summary = None
    sfile = d / "summary.json"
    if sfile.is_file():
        try:
            summary = json.loads(sfile.read_text())
        except json.JSONDecodeError:
            summary = None          # a torn summary is as good as none: fall back to the metrics
        if not isinstance(summary, dict):
            summary = None
    return {"name": d.resolve().name, "dir": str(d), "metrics": metrics, "final": final,
            "summary": summary, "complete": summary is not None, "config": run_config(d)}


def run_config(run_dir) -> Optional[dict]:
    """The settings the trainer wrote to ``run_dir``'s config.json at its start (its ``"config"``), so an
    interrupted run's setup is still known; None where the file is missing, unreadable or torn."""
    try:
        config = json.loads((Path(run_dir) / "config.json").read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        return None
    return config if isinstance(config, dict) else None


def _get(run: dict, key: str, default=None):
    """A run-level value: summary.json, else the final record, else the last round that has it."""
    for src in (run.get("summary"), run.get("final")):
        if src and src.get(key) is not None:
            return src[key]
    for rec in reversed(run["metrics"]):
        if rec.get(key) is not None:
            return rec[key]
    if key in _CONFIG_KEYS and run.get("config") and run["config"].get(key) is not None:
        return run["config"][key]
    return default


def _final_acc(run: dict) -> Optional[float]:
    """The finalized model's test accuracy, else the last evaluated round's."""
    for src in (run.get("summary"), run.get("final")):
        for key in ("final_test_acc", "test_acc"):
            if src and _num(src.get(key)):
                return float(src[key])
    for rec in reversed(run["metrics"]):
        if _num(rec.get("test_acc")):
            return float(rec["test_acc"])
    return None


def _final_point(run: dict, xkey: str):
    """(x, accuracy) of the finalized model when the run recorded one (summary.json or the final record)."""
    for src, acc in ((run.get("summary"), "final_test_acc"), (run.get("final"), "final_test_acc"),
                     (run.get("final"), "test_acc")):
        if src and _num(src.get(acc)) and _num(src.get(xkey)):
            return float(src[xkey]), float(src[acc])
    return None


def _short(layer: str) -> str:
    return layer[:-len(".weight")] if layer.endswith(".weight") else layer


def _label(run: dict) -> str:
    return run["name"] + ("" if run["complete"] else " (incomplete)")


def _series(run: dict, xkey: str, ykey: str):
    """(x, y) over the round records where both are numbers."""
    xs, ys = [], []
    for rec in run["metrics"]:
        x, y = rec.get(xkey), rec.get(ykey)
        if _num(x) and _num(y):
            xs.append(float(x))
            ys.append(float(y))
    return xs, ys


_SEED_SUFFIX = re.compile(r"^(?P<variant>.+)-s(?P<seed>\d+)$")


def variant_of(run: dict) -> str:
    """The run's name without a ``-s<seed>`` suffix: runs of one variant over several seeds share it."""
    m = _SEED_SUFFIX.match(run["name"])
    return m.group("variant") if m else run["name"]


def _by_variant(runs: list) -> dict:
    """{variant: [runs]} in first-seen order."""
    groups = {}
    for r in runs:
        groups.setdefault(variant_of(r), []).append(r)
    return groups


def epochs_to_target(run: dict, target: float) -> Optional[float]:
    """The epoch of the first evaluated round whose test accuracy is ≥ ``target``; None if none is."""
    return next((float(e) for e, a in zip(*_series(run, "epoch", "test_acc")) if a >= target), None)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _single_keep(sparsity):
    """``("channel", 0.5)`` when ``sparsity`` is one ``kind:K`` spec, else None."""
    if not isinstance(sparsity, str):
        return None
    from ..engine.sparsity import parse_spec
    try:
        spec = parse_spec(sparsity)
    except (ValueError, TypeError):
        return None
    return spec.parts[0] if len(spec.parts) == 1 else None


def _unique_names(runs):
    """Two runs from different parents may share a folder name; tell them apart by their parent."""
    seen = {}
    for r in runs:
        seen.setdefault(r["name"], []).append(r)
    for name, group in seen.items():
        if len(group) > 1:
            for r in group:
                r["name"] = f"{Path(r['dir']).resolve().parent.name}/{name}"


# ------------------------------------------------------------------------------------------------ table

def _fmt(v, spec: str) -> str:
    return format(v, spec) if _num(v) else "—"


def _cell(v) -> str:
    return "—" if v is None or v == "" else str(v).replace("|", "\\|")


def _ratio(a, b) -> Optional[float]:
    return a / b if _num(a) and _num(b) and b > 0 else None


def _times(ratio) -> str:
    """A ratio with three decimals, or two significant digits below 0.1 (0.0079, not 0.008)."""
    return _fmt(ratio, ".3f" if not _num(ratio) or ratio >= 0.1 else ".2g")


def _is_dense(run: dict) -> bool:
    return _get(run, "method") == DENSE_METHOD


def dense_reference(runs: list) -> Optional[dict]:
    """The first run of method ``dense`` that counted its inter-node bytes: the measured reference."""
    return next((r for r in runs if _is_dense(r) and _num(_get(r, "inter_bytes"))), None)


def counterfactual_label(run: dict) -> str:
    """What ``run``'s ``dense_inter_bytes`` counts, as its label: :data:`COUNTERFACTUAL` for the PruneX methods
    (their rounds, dense), :data:`COUNTERFACTUAL_STEPS` for the other methods (a dense run of the same steps)."""
    from .methods import METHODS, PRUNEX_METHODS
    method = _get(run, "method")
    if method in PRUNEX_METHODS:
        return COUNTERFACTUAL
    return COUNTERFACTUAL_STEPS if method in METHODS else COUNTERFACTUAL_ANY


def _sparsity(run: dict) -> str:
    """The run's sparsity spec; "none" for a method that prunes nothing (it was given the spec, not using it)."""
    from .methods import METHODS, PRUNING_METHODS
    method = _get(run, "method")
    if method in METHODS and method not in PRUNING_METHODS:
        return "none"
    return _cell(_get(run, "sparsity"))


def markdown_table(runs: list) -> str:
    """One markdown row per loaded run (see :func:`load_run`): setup, accuracy, density and traffic. With a
    measured dense run in ``runs`` (:func:`dense_reference`), a ``× dense run`` column: each run's inter-node
    bytes over that run's."""
    ref = dense_reference(runs)
    ref_bytes = _get(ref, "inter_bytes") if ref else None
    head = ["run", "method", "model", "dataset", "sparsity", "ranks", "final test acc %", "density",
            "inter-node MB"] + (["× dense run"] if ref else []) + [
            "counterfactual MB (dense, never sent)", "× counterfactual", "wall s"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 5 + ["---:"] * (len(head) - 5)) + "|"]
    for r in runs:
        nodes, rpn, world = _get(r, "num_nodes"), _get(r, "ranks_per_node"), _get(r, "world_size")
        ranks = f"{nodes}×{rpn}" if nodes is not None and rpn is not None else _cell(world)
        acc = _final_acc(r)
        inter, dense = _get(r, "inter_bytes"), _get(r, "dense_inter_bytes")
        row = [_label(r), _cell(_get(r, "method")), _cell(_get(r, "model")), _cell(_get(r, "dataset")),
               _sparsity(r), ranks, _fmt(acc * 100 if acc is not None else None, ".2f"),
               _fmt(_get(r, "density"), ".3f"), _fmt(inter / MB if _num(inter) else None, ".2f")]
        row += [_times(_ratio(inter, ref_bytes))] if ref else []
        row += [_fmt(dense / MB if _num(dense) else None, ".2f"), _times(_ratio(inter, dense)),
                _fmt(_get(r, "wall_s"), ".1f")]
        out.append("| " + " | ".join(row) + " |")
    return "\n".join(out) + "\n"


def summary_lines(runs: list) -> list:
    """Each run against the measured dense run, from the runs' own byte ledgers (``inter_bytes``): accuracy,
    density, inter-node MB and their ratio. Empty without a measured dense run in ``runs``."""
    ref = dense_reference(runs)
    if ref is None:
        return []
    ref_bytes = _get(ref, "inter_bytes")
    lines = [f"{_label(ref)} (measured reference: gradient allreduce every step): final test accuracy "
             f"{_pct(_final_acc(ref))}, {ref_bytes / MB:.2f} MB across nodes"]
    for r in runs:
        inter = _get(r, "inter_bytes")
        if r is ref or not _num(inter):
            continue
        ratio = _ratio(inter, ref_bytes)
        fewer = f" ({1 / ratio:.0f}x fewer bytes)" if ratio and ratio < 1 else ""
        lines.append(f"{_label(r)}: final test accuracy {_pct(_final_acc(r))} at density "
                     f"{_fmt(_get(r, 'density'), '.3f')}, {inter / MB:.2f} MB across nodes = "
                     f"{_times(ratio)}x the dense run's measured {ref_bytes / MB:.2f} MB" + fewer)
    return lines


def _pct(acc) -> str:
    return f"{acc * 100:.2f}%" if _num(acc) else "—"


def comparison_table(runs: list) -> str:
    """Methods side by side (``prunex-hvd compare``): accuracy, density, inter-node bytes and wall time,
    with bytes and time relative to the ``dense`` run when there is one."""
    dense = dense_reference(runs)
    base_bytes, base_wall = (_get(dense, "inter_bytes"), _get(dense, "wall_s")) if dense else (None, None)
    head = ["method", "final test acc %", "density", "inter-node MB", "× dense bytes", "wall s", "× dense time"]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in runs:
        acc, inter, wall = _final_acc(r), _get(r, "inter_bytes"), _get(r, "wall_s")
        out.append("| " + " | ".join([
            _cell(_get(r, "method")), _fmt(acc * 100 if acc is not None else None, ".2f"),
            _fmt(_get(r, "density"), ".3f"), _fmt(inter / MB if _num(inter) else None, ".2f"),
            _times(_ratio(inter, base_bytes)), _fmt(wall, ".1f"), _fmt(_ratio(wall, base_wall), ".2f")]) + " |")
    return "\n".join(out) + "\n"


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _target_cell(values: list) -> str:
    """Mean over the seeds that reached the target, with "(k/n)" when some did not; "—" when none did."""
    reached = [v for v in values if v is not None]
    if not reached:
        return "never"
    cell = f"{_mean(reached):.1f}"
    return cell if len(reached) == len(values) else f"{cell} ({len(reached)}/{len(values)})"


def target_table(runs: list, targets: list) -> str:
    """Per variant (seeds grouped): mean first epoch reaching each target, and the final accuracy."""
    head = ["variant", "seeds"] + [f"epochs to {t * 100:g}%" for t in targets] + ["final test acc % (min–max)"]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for variant, group in _by_variant(runs).items():
        finals = [a * 100 for a in map(_final_acc, group) if a is not None]
        final = "—" if not finals else (f"{_mean(finals):.2f}" if len(finals) == 1 else
                                         f"{_mean(finals):.2f} ({min(finals):.2f}–{max(finals):.2f})")
        cells = [_target_cell([epochs_to_target(r, t) for r in group]) for t in targets]
        out.append("| " + " | ".join([_cell(variant), str(len(group))] + cells + [final]) + " |")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------ figures

def _pyplot():
    import matplotlib
    matplotlib.use("Agg")   # files only; never needs a display
    import matplotlib.pyplot as plt
    return plt


_STYLE = {"axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
          "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 8, "legend.framealpha": 0.85,
          "figure.dpi": DPI, "savefig.dpi": DPI}


def _colours(n: int):
    plt = _pyplot()
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def _save(fig, path: Path, tight: bool = True) -> str:
    plt = _pyplot()
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return str(path)


def _fig_accuracy_time(runs, colours, path):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=_CURVES)
    drawn = False
    for r, c in zip(runs, colours):
        xs, ys = _series(r, "wall_s", "test_acc")
        if not xs:
            continue
        drawn = True
        ax.plot(xs, [y * 100 for y in ys], "-o", color=c, ms=4, lw=1.6, label=_label(r))
    if not drawn:
        plt.close(fig)
        return None
    _final_marks(ax, runs, colours, "wall_s", 1.0)
    ax.set(title="Test accuracy vs training time", xlabel="Wall time (s)", ylabel="Test accuracy (%)")
    ax.set_xlim(left=0)
    _legend(ax)
    return _save(fig, path)


def _fig_accuracy_epoch(groups, colours, path):
    """One line per variant: the mean over its seeds at each evaluated epoch, the seeds' range as a band."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=_CURVES)
    drawn = False
    for (variant, group), c in zip(groups.items(), colours):
        at = _by_epoch(group, "test_acc", 100)
        if not at:
            continue
        drawn = True
        xs = sorted(at)
        ax.plot(xs, [_mean(at[x]) for x in xs], "-o", color=c, ms=3, lw=1.6, label=_variant_label(variant, group))
        if len(group) > 1:
            ax.fill_between(xs, [min(at[x]) for x in xs], [max(at[x]) for x in xs], color=c, alpha=0.15, lw=0)
    if not drawn:
        plt.close(fig)
        return None
    ax.set(title="Test accuracy at equal epochs", xlabel="Epoch", ylabel="Test accuracy (%)")
    ax.set_xlim(left=0)
    _legend(ax)
    return _save(fig, path)


def _by_epoch(group: list, key: str, scale: float = 1.0) -> dict:
    """{epoch: [``key`` × ``scale`` of each run in ``group`` evaluated there]}."""
    at = {}
    for r in group:
        for e, v in zip(*_series(r, "epoch", key)):
            at.setdefault(round(e, 6), []).append(v * scale)
    return at


def _variant_label(variant: str, group: list) -> str:
    return variant + (f" ({len(group)} seeds)" if len(group) > 1 else "")


_LOSSES = (("test_loss", "-", "test loss (solid)"), ("train_loss", "--", "training loss (dashed)"))


def _fig_loss_epoch(groups, colours, path):
    """Per variant, the mean over its seeds at each epoch: test loss solid, training loss dashed; a log axis
    when the losses span more than a decade."""
    plt = _pyplot()
    from matplotlib.lines import Line2D
    fig, ax = plt.subplots(figsize=_CURVES)
    handles, values = [], []
    for (variant, group), c in zip(groups.items(), colours):
        drawn = False
        for key, style, _ in _LOSSES:
            at = _by_epoch(group, key)
            xs = sorted(at)
            ys = [_mean(at[x]) for x in xs]
            if xs:
                drawn = True
                values += ys
                ax.plot(xs, ys, style, color=c, lw=1.6 if style == "-" else 1.2, marker="o" if style == "-" else None,
                        ms=3)
        if drawn:
            handles.append(Line2D([], [], color=c, lw=6, label=_variant_label(variant, group)))
    if not handles:
        plt.close(fig)
        return None
    handles += [Line2D([], [], color="0.3", ls=style, lw=1.4, label=what) for _, style, what in _LOSSES]
    positive = [v for v in values if v > 0]
    if positive and max(positive) > 10 * min(positive):
        ax.set_yscale("log")
    ax.set(title="Loss per epoch (test solid, training dashed)", xlabel="Epoch",
           ylabel="Cross-entropy loss" + (" (log scale)" if ax.get_yscale() == "log" else ""))
    ax.set_xlim(left=0)
    _legend(ax, handles)
    return _save(fig, path)


def _fig_epochs_to_target(groups, colours, targets, path):
    """Grouped bars: per variant, the mean first epoch reaching each target; "never" where no seed did."""
    plt = _pyplot()
    rows = []   # (variant, colour, [values per target: [epochs or None per seed]])
    for (variant, group), c in zip(groups.items(), colours):
        rows.append((variant, c, [[epochs_to_target(r, t) for r in group] for t in targets]))
    longest = max((v for _, _, per in rows for vals in per for v in vals if v is not None), default=None)
    if longest is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.32 * len(rows) * len(targets)))
    height = 0.8 / len(targets)
    hatches = ["", "//", "..", "xx", "\\\\"]
    for i, (variant, c, per) in enumerate(rows):
        for j, (t, vals) in enumerate(zip(targets, per)):
            y = i + (j - (len(targets) - 1) / 2) * height
            reached = [v for v in vals if v is not None]
            if not reached:
                ax.text(0.2, y, f"{t * 100:g}%: never", va="center", fontsize=7, color="0.3")
                continue
            ax.barh(y, _mean(reached), height=height * 0.9, color=c, hatch=hatches[j % len(hatches)],
                    edgecolor="white" if j == 0 else "0.25", lw=0.5)
            note = f"{_mean(reached):.1f}" + ("" if len(reached) == len(vals) else f" ({len(reached)}/{len(vals)})")
            ax.text(_mean(reached) + longest * 0.01, y, note, va="center", fontsize=7)
    from matplotlib.patches import Patch
    handles = [Patch(facecolor="0.85", edgecolor="0.25", hatch=hatches[j % len(hatches)], label=f"to {t * 100:g}%")
               for j, t in enumerate(targets)]   # one entry per target, in the hatch that marks it
    ax.set_yticks(range(len(rows)), [v for v, _, _ in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, longest * 1.15)
    ax.set(title="Epochs to target accuracy (mean over seeds; fewer is better)", xlabel="Epoch")
    ax.grid(axis="y", visible=False)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return _save(fig, path)


def _final_marks(ax, runs, colours, xkey, xscale, logx=False):
    """A star per run at the finalized model's accuracy: after the last projection it can differ from the
    last round's."""
    drawn = False
    for r, c in zip(runs, colours):
        pt = _final_point(r, xkey)
        if pt and (pt[0] > 0 or not logx):
            ax.plot(pt[0] / xscale, pt[1] * 100, "*", color=c, ms=13, mec="black", mew=0.6, zorder=5)
            drawn = True
    if drawn:   # one neutral legend entry for all the stars
        ax.plot([], [], "*", color="0.6", ms=11, mec="black", mew=0.6, label="final model (after finalize)")


def _legend(ax, handles=None, **kw):
    """Beside the axes, on the right: a legend there never hides a curve or a bar."""
    kw = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, **kw)
    return ax.legend(handles=handles, **kw) if handles else ax.legend(**kw)


def _fig_accuracy_bytes(runs, colours, path):
    """Per run its accuracy against its measured cumulative inter-node MB (solid), and against its
    counterfactual's (in the run's colour, dashed or dotted by the kind of counterfactual: one legend entry
    per kind, so the legend stays one line per run)."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    curves = []   # (run, colour, sent MB, acc %, dense MB or None)
    for r, c in zip(runs, colours):
        xs, ys = _series(r, "inter_bytes", "test_acc")
        if not xs:
            continue
        dx, dy = _series(r, "dense_inter_bytes", "test_acc")
        # a dense run's counterfactual is its own measured curve: drawing it twice only clutters the legend
        same = _is_dense(r) or (len(dx) == len(xs) and
                                all(abs(a - b) <= 0.005 * max(abs(b), 1) for a, b in zip(xs, dx)))
        curves.append((r, c, [x / MB for x in xs], [y * 100 for y in ys],
                       None if (not dx or same) else ([x / MB for x in dx], [y * 100 for y in dy])))
    if not curves:
        return None
    pos = [x for _, _, xs, _, d in curves for x in xs + (d[0] if d else []) if x > 0]
    logx = bool(pos) and max(pos) > 10 * min(pos)
    fig, ax = plt.subplots(figsize=_CURVES)
    kinds = {}   # counterfactual label -> its line style
    for r, c, xs, ys, dense in curves:
        if logx:    # round 0 sent nothing: no place for it on a log axis
            xs, ys = zip(*[(x, y) for x, y in zip(xs, ys) if x > 0]) if any(x > 0 for x in xs) else ([], [])
        ax.plot(xs, ys, "-o", color=c, ms=4, lw=1.6, label=_label(r))
        if dense:
            dxs, dys = dense
            if logx:
                pts = [(x, y) for x, y in zip(dxs, dys) if x > 0]
                dxs, dys = zip(*pts) if pts else ([], [])
            kind = counterfactual_label(r)
            style = kinds.setdefault(kind, _COUNTERFACTUAL_STYLES.get(kind, "-."))
            ax.plot(dxs, dys, style, color=c, lw=1.3, alpha=0.55)
    for kind, style in kinds.items():
        ax.plot([], [], style, color="0.35", lw=1.3, label=f"{kind}\n(in its run's colour)")
    _final_marks(ax, runs, colours, "inter_bytes", MB, logx)
    if logx:
        ax.set_xscale("log")
        # 1-2-5 ticks written plainly (0.2, 1, 50), rather than 10^k majors and crowded minor labels
        subs = (1.0, 2.0, 5.0) if max(pos) < 300 * min(pos) else (1.0,)   # wide ranges: decades only
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set(title="Test accuracy vs inter-node traffic", xlabel="Cumulative inter-node traffic (MB"
           + (", log scale)" if logx else ")"), ylabel="Test accuracy (%)")
    _legend(ax)
    return _save(fig, path)


def _layer_order(dicts):
    """Layer names in first-seen order (the model's order, as JSON objects keep key order)."""
    names = {}
    for d in dicts:
        for k in d or {}:
            names.setdefault(k, None)
    return list(names)


def _residual_layers(run: dict, recs: list):
    """(the conv layers drawn, how many conv layers there are): up to :data:`_RESIDUAL_MAX_LAYERS`, spread
    over depth. The engine also reports BN and FC tensors; the figure is about the conv layers."""
    layers = _layer_order(m["residuals"] for m in recs)
    convs = set(_layer_density(run) or ())
    if convs & set(layers):
        layers = [n for n in layers if n in convs]
    return _spread(layers, _RESIDUAL_MAX_LAYERS), len(layers)


def _layer_styles(n: int):
    """(colour, line style) per layer: a qualitative palette, and a style that changes between neighbours,
    so no two lines share both."""
    return [(c, _LINE_STYLES[i % len(_LINE_STYLES)]) for i, c in enumerate(_colours(n))]


def _residual_panel(ax, recs, layers, styles, key, what, title):
    """One run's ``key`` residual per layer over rounds; says so in the panel when nothing positive was."""
    from matplotlib.ticker import MaxNLocator
    drawn = seen = False
    for layer, (colour, style) in zip(layers, styles):
        xs, ys = [], []
        for m in recs:
            v = (m["residuals"].get(layer) or {}).get(key)
            seen = seen or _num(v)
            if _num(v) and v > 0 and _num(m.get("round")):
                xs.append(m["round"])
                ys.append(v)
        if xs:
            drawn = True
            ax.plot(xs, ys, color=colour, ls=style, lw=1.4, marker="." if len(xs) < 30 else None)
    ax.set_title(f"{title}: {what} ({key})")
    ax.set_xlabel("Consensus round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"{key} (L2 norm, log scale)")
    if drawn:
        ax.set_yscale("log")
        return
    ax.text(0.5, 0.5, f"{key} = 0 in every round" if seen else f"no {key} recorded",
            ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _fig_residuals(runs, path):
    """A row per run, a column per tier; one line per conv layer (up to ten, spread over depth), named in
    the row's legend beside the last panel."""
    plt = _pyplot()
    from matplotlib.lines import Line2D
    have = [r for r in runs if any(isinstance(m.get("residuals"), dict) and m["residuals"] for m in r["metrics"])]
    if not have:
        return None
    racks = any("r_spine" in (res or {}) for r in have for m in r["metrics"]
                for res in (m.get("residuals") or {}).values() if isinstance(res, dict))
    columns = RESIDUALS if racks else RESIDUALS[:2]
    fig, axes = plt.subplots(len(have), len(columns), figsize=(5.6 * len(columns) + 2.4, 3.3 * len(have) + 0.4),
                             squeeze=False, layout="constrained")
    for row, r in zip(axes, have):
        recs = [m for m in r["metrics"] if isinstance(m.get("residuals"), dict)]
        layers, total = _residual_layers(r, recs)
        styles = _layer_styles(len(layers))
        for ax, (key, what) in zip(row, columns):
            _residual_panel(ax, recs, layers, styles, key, what, _label(r))
        handles = [Line2D([], [], color=c, ls=ls, lw=1.6, label=_short(n)) for n, (c, ls) in zip(layers, styles)]
        shown = f"all {total}" if len(layers) == total else f"{len(layers)} of {total}, spread over depth"
        row[-1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0,
                       title=f"conv layer ({shown})", title_fontsize=8, fontsize=7)
    return _save(fig, path, tight=False)   # constrained layout already made room for the legends


def _layer_density(run):
    for src in (run.get("summary"), run.get("final")):
        if src and isinstance(src.get("layer_density"), dict) and src["layer_density"]:
            return src["layer_density"]
    for rec in reversed(run["metrics"]):
        if isinstance(rec.get("layer_density"), dict) and rec["layer_density"]:
            return rec["layer_density"]
    return None


def _fig_density(runs, colours, path):
    plt = _pyplot()
    have = [(r, c, _layer_density(r)) for r, c in zip(runs, colours)]
    have = [(r, c, ld) for r, c, ld in have if ld]
    if not have:
        return None
    layers = _layer_order(ld for _, _, ld in have)
    n, k = len(layers), len(have)
    width = 0.8 / k
    fig, ax = plt.subplots(figsize=(min(max(7, 0.3 * n * max(1, k / 2) + 2), 28) + 2.5, 4.8))   # + legend
    for j, (r, c, ld) in enumerate(have):
        xs = [i + (j - (k - 1) / 2) * width for i, name in enumerate(layers) if _num(ld.get(name))]
        ys = [ld[name] for name in layers if _num(ld.get(name))]
        ax.bar(xs, ys, width=width, color=c, label=_label(r), edgecolor="white", linewidth=0.4)
    keeps = {}   # (kind, K) -> runs asking for it
    for r, c, _ in have:
        kk = _single_keep(_get(r, "sparsity"))
        if kk:
            keeps.setdefault(kk, []).append(c)
    for (kind, keep), cs in keeps.items():
        colour = cs[0] if len(cs) == 1 and k > 1 else "0.3"
        ax.axhline(keep, ls="--", lw=1.1, color=colour, label=f"requested keep {keep:g} ({kind})")
    ax.set_xticks(range(n))
    ax.set_xticklabels([_short(n) for n in layers], rotation=60 if n > 3 else 0, ha="right" if n > 3 else "center",
                       fontsize=8 if n <= 20 else 6)
    ax.set_ylim(0, 1.08)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set(title="Final density per conv layer", xlabel="Conv layer",
           ylabel="Density (fraction of weights kept)")
    ax.grid(axis="x", visible=False)
    _legend(ax)
    return _save(fig, path)


def _structured_layers(state_dict) -> list:
    """(name, GEMM view |W|, zero-row mask, zero-col mask) of the 4-D weights with a pruned row or column."""
    import torch
    out = []
    for name, t in state_dict.items():
        if not (isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point()):
            continue
        g = t.detach().float().reshape(t.shape[0], -1).abs()
        zero_rows = (g == 0).all(dim=1)
        zero_cols = (g == 0).all(dim=0)
        if zero_rows.any() or zero_cols.any():
            out.append((name, g, zero_rows, zero_cols))
    return out


def _spread(items: list, k: int) -> list:
    """Up to ``k`` items evenly spaced from first to last, so shallow and deep layers both show."""
    if len(items) <= k:
        return items
    if k <= 1:
        return items[:max(k, 0)]
    idx = sorted({round(i * (len(items) - 1) / (k - 1)) for i in range(k)})
    return [items[i] for i in idx]


def _fig_masks(run, path, max_layers):
    f = Path(run["dir"]) / "final_model.pt"
    if max_layers < 1 or not f.is_file():
        return None
    import numpy as np
    import torch
    try:
        blob = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:   # a torn or foreign checkpoint should not cost the other figures
        warnings.warn(f"{f}: cannot load ({exc}); skipping its mask figure")
        return None
    sd = blob.get("state_dict", blob) if isinstance(blob, dict) else {}
    layers = _spread(_structured_layers(sd), max_layers)
    if not layers:
        return None
    plt = _pyplot()
    ncols = min(2, len(layers))
    nrows = math.ceil(len(layers) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 3.9 * nrows + 0.5), squeeze=False)
    # exact zeros (the pruned groups) are masked and drawn white, apart from even the smallest kept weight
    cmap = plt.get_cmap("magma").with_extremes(bad="white")
    for ax, (name, g, zr, zc) in zip(axes.flat, layers):
        a = g.numpy()
        nz = a[a > 0]
        scale = float(np.median(nz)) if nz.size else 1.0   # contrast relative to a typical kept weight
        img = np.ma.masked_where(a == 0, np.log1p(a / scale))
        # a big layer has more rows than pixels: blend in RGBA so white (pruned) rows are not just dropped
        im = ax.imshow(img, cmap=cmap, aspect="auto", interpolation="antialiased", interpolation_stage="rgba")
        rows_kept, cols_kept = int((~zr).sum()), int((~zc).sum())
        ax.set_title(f"{name}  ({a.shape[0]}×{a.shape[1]})\nrows kept {rows_kept}/{a.shape[0]} "
                     f"({rows_kept / a.shape[0]:.0%}), cols kept {cols_kept}/{a.shape[1]} "
                     f"({cols_kept / a.shape[1]:.0%})", fontsize=9)
        ax.set_xlabel("GEMM column (C_in·KH·KW)")
        ax.set_ylabel("Output filter (row)")
        ax.grid(False)
        for side in ax.spines.values():   # a frame, so pruned edge rows do not melt into the page
            side.set_visible(True)
            side.set_color("0.6")
        cb = fig.colorbar(im, ax=ax, pad=0.01)
        cb.set_label("log(1 + |W| / median |W|)", fontsize=8)
    for ax in list(axes.flat)[len(layers):]:
        ax.set_visible(False)
    spars = blob.get("sparsity") if isinstance(blob, dict) else None
    fig.suptitle(f"{_label(run)}: final conv weights, GEMM view (white = pruned)"
                 + (f", sparsity {spars}" if spars else ""), fontsize=11)
    return _save(fig, path)


def _traffic_note(sent: float, counterfactual, ref_mb, is_ref: bool, narrow: bool = False) -> str:
    """What is written over a run's measured bar: its MB (a log axis is hard to read off), then its ratio to
    the measured dense run, else to its counterfactual (``narrow``: the ratio over two lines)."""
    if is_ref:
        ratio = "the reference"
    elif ref_mb:
        ratio = f"{sent / ref_mb:.2g}× dense run"
    else:
        ratio = f"{sent / counterfactual:.3f}× counterfactual" if counterfactual else ""
    if narrow:
        ratio = ratio.replace("× ", "×\n", 1)
    return f"{sent:.3g} MB" + (f"\n{ratio}" if ratio else "")


def _fig_communication(runs, colours, path):
    """Per run its measured inter-node MB (solid) beside its counterfactual (hatched; not for a dense run, whose
    counterfactual is what it measured), with the MB and a ratio over the measured bar. The legend names the
    counterfactual when all runs share one kind; else each hatched bar says which it is."""
    plt = _pyplot()
    from matplotlib.patches import Patch
    have = []   # (run, colour, measured MB, counterfactual MB or None)
    for r, c in zip(runs, colours):
        inter, dense = _get(r, "inter_bytes"), _get(r, "dense_inter_bytes")
        if _num(inter):
            cf = dense / MB if _num(dense) and dense > 0 and not _is_dense(r) else None
            have.append((r, c, inter / MB, cf))
    if not have:
        return None
    kinds = {counterfactual_label(r) for r, _, _, cf in have if cf is not None}
    ref = dense_reference(runs)
    ref_mb = _get(ref, "inter_bytes") / MB if ref else None
    narrow = len(have) > 3   # then each run's notes take two lines more, its bars less width
    fig, ax = plt.subplots(figsize=(min(max(5.5, (1.6 if narrow else 2.2) * len(have) + 2.5), 16) + 2.8, 4.5))
    pos = [v for _, _, s, d in have for v in (s, d) if v is not None and v > 0] or [1.0]
    top, low = max(pos), min(pos)
    logy = top > 30 * low   # a small run next to a big one would be an invisible sliver on a linear axis
    lift = (lambda v: max(v, low) * 1.08) if logy else (lambda v: v + 0.015 * top)   # just over a bar
    for i, (r, c, sent, cf) in enumerate(have):
        _traffic_bars(ax, i, c, sent, cf, lift, _traffic_note(sent, cf, ref_mb, r is ref, narrow),
                      counterfactual_label(r) if len(kinds) > 1 else None)
    ax.set_xticks(range(len(have)))
    ax.set_xticklabels([_label(r) for r, *_ in have], rotation=20 if len(have) > 3 else 0,
                       ha="right" if len(have) > 3 else "center")
    if logy:
        ax.set_yscale("log")
        ax.set_ylim(low / 2, top * 4)
    else:
        ax.set_ylim(0, top * 1.15)   # headroom for the notes
    ax.set(title="Inter-node traffic per run: measured" + (" (solid) and counterfactual (hatched)" if kinds else ""),
           ylabel="Inter-node traffic (MB" + (", log scale)" if logy else ")"))
    ax.grid(axis="x", visible=False)
    handles = [Patch(facecolor="0.35", label="measured: sent across nodes\n(the run's byte ledger)")]
    if kinds:
        handles.append(Patch(facecolor="0.35", alpha=0.3, hatch="//", edgecolor="0.35",
                             label=f"{kinds.pop() if len(kinds) == 1 else COUNTERFACTUAL_ANY}\n(never sent)"))
    _legend(ax, handles)
    return _save(fig, path)


def _traffic_bars(ax, i, colour, sent, cf, lift, note, cf_label=None):
    """Run ``i``'s measured bar with ``note`` over it (bold), and its counterfactual bar beside it, with what
    that counts over it (``cf_label``, grey) when the legend cannot say."""
    w = 0.38
    x = i - w / 2 if cf is not None else i
    ax.bar(x, sent, w, color=colour, edgecolor=colour)
    ax.text(x, lift(sent), note, ha="center", va="bottom", fontsize=8, fontweight="bold", linespacing=1.2)
    if cf is None:
        return
    ax.bar(i + w / 2, cf, w, color=colour, alpha=0.3, edgecolor=colour, hatch="//")
    if cf_label:
        what = cf_label.split(": ", 1)[-1]
        ax.text(i + w / 2, lift(cf), what.replace(" sent ", "\nsent ").replace(" every ", "\nevery "),
                ha="center", va="bottom", fontsize=7, color="0.3", linespacing=1.1)


# ------------------------------------------------------------------------------------------------ report

def _file_safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "run"


def make_report(run_dirs: list, out_dir: Optional[str] = None, max_mask_layers: int = 4,
                targets: Optional[list] = None) -> dict:
    """Load ``run_dirs``, write the figures that some run has data for and ``report.md`` into ``out_dir``.
    With ``targets`` (accuracies in (0, 1]) also the epochs-to-target figure and table.

    Returns ``{"out_dir", "figures": {key: path}, "table": path, "summary": [lines]}``; ``figures`` lists only
    what was written (keys: the file stems, e.g. ``"accuracy_vs_time"``, ``"masks_<run>"``); ``summary`` is
    :func:`summary_lines` (empty without a measured dense run). Raises ValueError for a path
    that is not a run directory (see :func:`load_run`).
    """
    if isinstance(run_dirs, (str, Path)):   # one run passed bare: not a list of its characters
        run_dirs = [run_dirs]
    if not run_dirs:
        raise ValueError("no run directories given")
    targets = sorted(float(t) for t in (targets or []))
    if any(not 0 < t <= 1 for t in targets):
        raise ValueError(f"targets must be accuracies in (0, 1], got {targets}")
    runs = [load_run(p) for p in run_dirs]
    _unique_names(runs)
    groups = _by_variant(runs)
    out = Path(out_dir) if out_dir is not None else Path(run_dirs[0]).resolve().parent / "report"
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    colours = _colours(len(runs))
    figures = {}
    with plt.rc_context(_STYLE):
        group_colours = _colours(len(groups))
        for key, draw in (("accuracy_vs_epoch", lambda p: _fig_accuracy_epoch(groups, group_colours, p)),
                          ("loss_vs_epoch", lambda p: _fig_loss_epoch(groups, group_colours, p)),
                          ("epochs_to_target", lambda p: targets and _fig_epochs_to_target(
                              groups, group_colours, targets, p)),
                          ("accuracy_vs_time", lambda p: _fig_accuracy_time(runs, colours, p)),
                          ("accuracy_vs_inter_bytes", lambda p: _fig_accuracy_bytes(runs, colours, p)),
                          ("residuals", lambda p: _fig_residuals(runs, p)),
                          ("density_per_layer", lambda p: _fig_density(runs, colours, p)),
                          ("communication", lambda p: _fig_communication(runs, colours, p))):
            written = draw(out / f"{key}.png")
            if written:
                figures[key] = written
        for r in runs:
            key = f"masks_{_file_safe(r['name'])}"
            written = _fig_masks(r, out / f"{key}.png", max_mask_layers)
            if written:
                figures[key] = written
    table, summary = out / "report.md", summary_lines(runs)
    table.write_text(report_markdown(runs, figures, summary, targets))
    return {"out_dir": str(out), "figures": figures, "table": str(table), "summary": summary}


# (title, caption) per figure: the caption says what the figure shows and how to read it
FIGURES = {
    "accuracy_vs_epoch": ("Test accuracy at equal epochs",
                          "Test accuracy after each epoch, higher is better; over several seeds the line is "
                          "their mean and the band their range."),
    "loss_vs_epoch": ("Loss per epoch",
                      "Cross-entropy per epoch, one colour per run: test loss solid, training loss (mean over "
                      "the epoch's batches) dashed; lower is better, a rising test curve under a falling "
                      "training one is overfitting."),
    "epochs_to_target": ("Epochs to target",
                         "First epoch whose test accuracy reaches each target, mean over seeds; shorter bars "
                         "are better, \"never\" where no seed got there."),
    "accuracy_vs_time": ("Test accuracy vs wall time",
                         "Test accuracy against cumulative training wall time on this machine; curves further "
                         "left got there sooner, stars are the final model."),
    "accuracy_vs_inter_bytes": ("Test accuracy vs inter-node traffic",
                                "Test accuracy against cumulative inter-node MB, measured (solid, from each run's "
                                "byte ledger); dashed, the run's counterfactual (never sent, see Terms); further "
                                "left is cheaper, stars are the final model."),
    "residuals": ("Per-layer primal residuals",
                  "How far each conv layer's copies are from their consensus, per round (log scale): within a "
                  "node (r_intra) and between nodes (r_inter); falling lines mean the copies agree; the legend "
                  "names the layers drawn (at most ten, spread over depth)."),
    "density_per_layer": ("Final density per layer",
                          "Fraction of each conv layer's weights the final model keeps (1 = not pruned); the "
                          "dashed line is the keep ratio asked for, which with one budget across layers holds "
                          "for the model, not for each layer."),
    "communication": ("Inter-node traffic per run",
                      "Inter-node MB over the whole run: solid bars measured, hatched bars the counterfactual "
                      "(never sent, see Terms); over each solid bar its MB and its ratio to the measured dense "
                      "run, or to its counterfactual when there is none."),
}
_MASKS = ("Pruned weights: {run}",
          "The final model's conv weights as GEMM matrices (rows: output filters, columns: input channel × "
          "kernel position), white where pruned, colour |W| against the median kept weight.")

TERMS = [
    "**Inter-node bytes** (`inter_bytes`): what the ranks' collectives sent across node boundaries during "
    "training, summed over the ranks, as the run's byte ledger counts every collective under a ring model of "
    "its algorithm (exact for two nodes); the first broadcast of the weights and evaluation are not counted. "
    "MB = 2^20 bytes.",
    "**Dense run**: a run of method `dense`, data-parallel training as Horovod does it: an allreduce of the "
    "whole gradient every step. Measured like every other run, it is the reference the `× dense run` column "
    "divides by.",
    "**Counterfactual** (`dense_inter_bytes`, also called dense-equivalent): bytes the trainer computes and "
    f"never sends. For PruneX (\"{COUNTERFACTUAL}\") its consensus rounds had each been a dense allreduce of "
    "the whole model: how much each exchange was compressed, not the saving against a dense run, which "
    f"exchanges every step. For the other methods (\"{COUNTERFACTUAL_STEPS}\") what a dense run of the same "
    "steps would send.",
    "**Density**: the fraction of the prunable conv weights the final model keeps (1.000 = nothing pruned).",
    "**Ratio** (`× dense run`, `× counterfactual`): a run's inter-node bytes over the dense run's measured "
    "bytes, or over its own counterfactual; below 1 is fewer bytes.",
    "**Final model**: the weights after `finalize` (for PruneX the last projection onto the structured-sparse "
    "set, the same on every rank), BatchNorm statistics recalibrated on training batches; its accuracy is the "
    "table's final test accuracy and the stars in the figures.",
]


def against_dense(summary: list) -> list:
    """:func:`summary_lines` as markdown lines under their heading; none without a measured dense run."""
    return ["Against the measured dense run:", ""] + [f"* {line}" for line in summary] + [""] if summary else []


def report_markdown(runs: list, figures: dict, summary: list, targets: Optional[list] = None) -> str:
    """``report.md``: against the measured dense run (``summary``, :func:`summary_lines`), the table, the terms,
    the epochs-to-target table (with ``targets``), then every figure in ``figures`` with its caption."""
    md = ["# Training report", ""] + against_dense(summary)
    md += [markdown_table(runs), "## Terms", ""] + [f"* {t}" for t in TERMS] + [""]
    if targets:
        md += ["## Epochs to target", "", target_table(runs, targets)]
    for key, p in figures.items():
        title, caption = FIGURES.get(key) or (_MASKS[0].format(run=key[len("masks_"):]), _MASKS[1])
        md += [f"## {title}", "", f"![{title}]({Path(p).name})", "", f"*{caption}*", ""]
    return "\n".join(md)


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``report`` arguments, for a stand-alone parser or a ``prunex-hvd`` sub-command."""
    ap.add_argument("runs", nargs="+", metavar="RUN", help="run directories (each with metrics.jsonl)")
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="where to write the figures and report.md (default: <parent of the first run>/report)")
    ap.add_argument("--mask-layers", type=int, default=4, metavar="N",
                    help="conv layers to draw per run in masks_<run>.png (default 4)")
    ap.add_argument("--targets", type=_accuracies, default=None, metavar="A,B",
                    help="test accuracies (e.g. 0.9,0.95): adds epochs_to_target.png and a table of the first "
                         "epoch each variant reaches them")
    return ap


def _accuracies(text: str) -> list:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated accuracies like 0.9,0.95, got {text!r}")
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"accuracies must lie in (0, 1], got {text!r}")
    return values


def run_args(args) -> int:
    """Make the report for parsed arguments; prints the written paths."""
    res = make_report(args.runs, out_dir=args.out, max_mask_layers=args.mask_layers,
                      targets=args.targets)
    for p in res["figures"].values():
        print(p)
    print(res["table"])
    if res["summary"]:
        print("\nagainst the measured dense run (from the runs' byte ledgers):")
        for line in res["summary"]:
            print("  " + line)
    return 0


def main(argv=None) -> int:
    """``prunex-hvd report RUN [RUN ...] [--out DIR] [--mask-layers N]`` (argv without the word "report").

    Returns 0, or 2 with the error on stderr when a run directory is unusable.
    """
    ap = add_arguments(argparse.ArgumentParser(prog="prunex-hvd report",
                                               description="Training runs → PNG figures and a markdown table."))
    args = ap.parse_args(argv)
    try:
        return run_args(args)
    except ValueError as exc:
        print(f"prunex-hvd report: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
