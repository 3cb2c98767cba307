"""Turn the benchmarks' JSON into plots and one markdown table.

    python benchmarks/report.py runs/bench/*.json [--out runs/bench/report]

Each file is recognised by its ``"benchmark"`` key (volume, scaling, wrapper_overhead, shrink_recover,
emulated_cluster) or ``"bench"`` (learning: ``--variants a,b`` draws only those); unknown files are skipped with
a note. Writes a PNG per benchmark (learning: one per task) and ``bench.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MB = 2 ** 20


def _save(fig, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def volume(d: dict, out: str, md: List[str]) -> List[str]:
    models = d["models"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, m in models.items():
        rounds = m["measured_rounds"]
        axes[0].plot([r["round"] for r in rounds], [r["message_MiB_per_leader"] for r in rounds], "o-",
                     label=f"{name} PruneX")
        axes[0].plot([r["round"] for r in rounds], [r["dense_MiB_per_leader"] for r in rounds], "--", alpha=0.5,
                     label=f"{name} dense")
        for kind, style in (("channel", "-"), ("channel-coupled", "--"), ("channel-streams", (0, (5, 1))),
                            ("filter", ":"), ("composite", "-.")):
            if kind not in m["sweep"]:
                continue
            keeps = sorted(m["sweep"][kind], key=float)
            axes[1].plot([float(k) for k in keeps], [m["sweep"][kind][k]["or"] for k in keeps], ls=style, marker="o",
                         label=f"{name} {kind}")
    axes[0].set(title="Message per leader per round (Fig. 6a)", xlabel="consensus round", ylabel="MiB")
    axes[1].axhline(0.40, color="k", lw=0.8, ls="--")
    axes[1].text(0.31, 0.42, "paper: 0.40× at keep 0.5", fontsize=8)
    axes[1].set(title="Compact / dense per round vs keep ratio (OR of 2 nodes' masks)", xlabel="keep ratio",
                ylabel="× dense")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    kinds = [k for k in ("filter", "channel", "channel-coupled", "channel-streams", "composite")
             if all(k in m["sweep"] for m in models.values())]
    setup = d.get("setup", "")
    coupling = " coupled streams" if "streams" in setup else " coupled" if "coupled" in setup else ""
    md += ["## Inter-node volume (bench_volume)", "",
           f"| model | dense MiB/round | engine run total (channel 0.5{coupling}) | "
           f"keep 0.5 frozen: {' / '.join(kinds)} |", "|---|---:|---:|---|"]
    for name, m in models.items():
        sw = m["sweep"]
        md.append(f"| {name} | {m['dense_MiB_per_round']:.1f} | {m['run_totals']['ratio_all_inter']:.3f}× | "
                  + " / ".join(f"{sw[k]['0.5']['frozen']:.3f}" for k in kinds) + " |")
    return [_save(fig, out, "volume.png")]


def scaling(d: dict, out: str, md: List[str]) -> List[str]:
    scenario = d["speedup_8_to_64"]
    key = next((k for k in scenario if "paper" in k), next(iter(scenario)))
    models = scenario[key]
    fig, ax = plt.subplots(figsize=(7, 4))
    methods = list(next(iter(models.values())))
    width = 0.8 / len(models)
    for i, (name, row) in enumerate(models.items()):
        ax.bar([j + i * width for j in range(len(methods))], [row[m] for m in methods], width, label=name)
    ax.axhline(8, color="k", lw=0.8, ls="--")
    ax.set_xticks([j + width * (len(models) - 1) / 2 for j in range(len(methods))], methods)
    ax.set(title=f"Modelled speedup 8→64 GPUs ({key})", ylabel="speedup (ideal 8)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    md += ["", f"## Scaling model (bench_scaling, {key}; assumptions in the JSON)", "",
           "| model | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    md += [f"| {name} | " + " | ".join(f"{row[m]:.2f}" for m in methods) + " |" for name, row in models.items()]
    return [_save(fig, out, "scaling.png")]


def overhead(d: dict, out: str, md: List[str]) -> List[str]:
    md += ["", f"## Wrapper overhead (bench_overhead, {d['model']}, batch {d['batch_size']}, CPU)", "",
           "| phase | median wrapped/bare | bare step s | wrapped step s |", "|---|---:|---:|---:|"]
    md += [f"| {p} | {r['median_ratio']:.3f} | {r['median_step_s_bare']:.3f} | {r['median_step_s_wrapped']:.3f} |"
           for p, r in d["phases"].items()]
    return []


def shrink(d: dict, out: str, md: List[str]) -> List[str]:
    paths = []
    for dev, r in d["results"].items():
        cases = r["cases"]
        fig, ax = plt.subplots(figsize=(10, 4))
        labels = [f"{'x'.join(map(str, c['shape']))}\n{c['spec']}" for c in cases]
        xs = range(len(cases))
        ax.bar([x - 0.2 for x in xs], [c["shrink_vs_copy"] for c in cases], 0.4, label="shrink / copy")
        ax.bar([x + 0.2 for x in xs], [c["recover_vs_copy"] for c in cases], 0.4, label="recover / copy")
        aten = "shrink_vs_copy_aten" in cases[0]   # CPU: the same cases through ATen alone, side by side
        if aten:
            ax.plot([x - 0.2 for x in xs], [c["shrink_vs_copy_aten"] for c in cases], "k_", ms=9, mew=2,
                    label="ATen alone (no kernel)")
            ax.plot([x + 0.2 for x in xs], [c["recover_vs_copy_aten"] for c in cases], "k_", ms=9, mew=2)
        ax.axhline(0.5, color="k", lw=0.8, ls="--")
        ax.set_xticks(list(xs), labels, rotation=90, fontsize=6)
        ax.set(title=f"Shrink / recover throughput vs a copy of the same tensor ({dev})", ylabel="× copy")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
        paths.append(_save(fig, out, f"shrink_{dev}.png"))
        md += ["", f"## Shrink + recover vs copy (bench_shrink, {dev})", "",
               f"per layer: median shrink {r['median_shrink_vs_copy']:.2f}×, recover "
               f"{r['median_recover_vs_copy']:.2f}× of copying the same tensor (target ≥ 0.5); shrink against "
               f"copying only the compact bytes: {r.get('median_shrink_vs_copy_compact', float('nan')):.2f}×; "
               f"lowest: shrink {r['min_shrink_vs_copy']:.2f}×, recover {r['min_recover_vs_copy']:.2f}×."]

        def pair(c, suffix=""):
            return f"{c['shrink_vs_copy' + suffix]:.2f} / {c['recover_vs_copy' + suffix]:.2f}"
        extra = " | ATen alone" if aten else ""
        md += ["", f"| layer | spec | by | shrink / recover × copy{extra} |", "|---|---|---|---:|" + "---:|" * aten]
        md += [f"| {'×'.join(map(str, c['shape']))} | {c['spec']} | {c['recover_by']} | {pair(c)}"
               + (f" | {pair(c, '_aten')}" if aten else "") + " |" for c in cases]
        if r.get("models"):
            md += ["", f"| model | spec | conv MB | compact MB | shrink / recover × dense pack / unpack{extra} |",
                   "|---|---|---:|---:|---:|" + "---:|" * aten]
            md += [f"| {m['model']} | {m['spec']} | {m['conv_MB']:.1f} | {m['compact_MB']:.1f} | {pair(m)}"
                   + (f" | {pair(m, '_aten')}" if aten else "") + " |" for m in r["models"]]
    return paths


def cluster(d: dict, out: str, md: List[str]) -> List[str]:
    rows = d.get("results", [])
    if not rows:
        return []
    bws = sorted({r["bandwidth"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(bws))
    for i, bw in enumerate(bws):
        vals = [next((r.get("time_to_target_s") or 0 for r in rows if r["bandwidth"] == bw and r["method"] == m), 0)
                for m in methods]
        ax.bar([j + i * width for j in range(len(methods))], vals, width, label=bw)
    ax.set_xticks([j + width * (len(bws) - 1) / 2 for j in range(len(methods))], methods)
    ax.set(title="Emulated cluster: wall time to target accuracy", ylabel="seconds (0: not reached)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    md += ["", "## Emulated cluster (emulated_cluster.py)", "",
           "| bandwidth | method | time to target s | final acc % | kernel MB | library ledger MB | kernel/ledger |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        k = r.get("kernel_inter_bytes")   # all the job's frames: compare with the whole ledger, not training only
        lib = r.get("library_ledger_cross_node_bytes") or r.get("library_inter_bytes")
        ttt = r.get("time_to_target_s")
        md.append(f"| {r['bandwidth']} | {r['method']} | {'—' if ttt is None else f'{ttt:.1f}'} | "
                  f"{100 * (r.get('final_test_acc') or 0):.2f} | {(k or 0) / MB:.2f} | {(lib or 0) / MB:.2f} | "
                  f"{(k / lib) if k and lib else float('nan'):.3f} |")
    return [_save(fig, out, "cluster.png")]


def learning(d: dict, out: str, md: List[str], variants=None) -> List[str]:
    """``bench_learning.py``'s JSON (several files' runs may be merged into one): per task, the test accuracy at
    equal epochs of each variant, the mean over its seeds with their range as a band, and a table of the final
    accuracy and the epochs to each target (means over the seeds that reached it: counted in the table)."""
    runs = [r for r in d["runs"] if r.get("rc") == 0 and (variants is None or r["variant"] in variants)]
    pngs = []
    for task in sorted({r["task"] for r in runs}):
        by_variant: Dict[str, List[dict]] = {}
        for r in runs:
            if r["task"] == task:
                label = f'{r["variant"]} {r["extra"]}' if r.get("extra") else r["variant"]   # bench --extra
                by_variant.setdefault(label, []).append(r)
        fig, (ax, tail) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
        tail_low = 100.0
        md += [f"## learning: {task}", "", "| variant | seeds | final % | epochs to " +
               " / ".join(f"{float(t):.0%}" for t in next(iter(by_variant.values()))[0]["epochs_to"]) + " |",
               "|---|---|---|---|"]
        for variant, rs in by_variant.items():
            n = min(len(r["curve"]) for r in rs)
            epochs = [rs[0]["curve"][i][0] for i in range(n)]
            accs = [[r["curve"][i][1] * 100 for r in rs] for i in range(n)]
            means = [sum(a) / len(a) for a in accs]
            line, = ax.plot(epochs, means, label=f"{variant} ({len(rs)})")
            ax.fill_between(epochs, [min(a) for a in accs], [max(a) for a in accs], color=line.get_color(), alpha=0.12)
            half = [i for i, e in enumerate(epochs) if e >= epochs[-1] / 2]   # the second half, the means close up
            tail.plot([epochs[i] for i in half], [means[i] for i in half], "o-", ms=3, color=line.get_color())
            tail_low = min(tail_low, min(means[i] for i in half))
            reached = {t: [r["epochs_to"][t] for r in rs if r["epochs_to"][t] is not None] for t in rs[0]["epochs_to"]}
            final = sum(r["final_acc"] for r in rs) / len(rs) * 100
            md.append(f"| {variant} | {len(rs)} | {final:.2f} | " + " / ".join(
                f"{sum(v) / len(v):.1f}" + ("" if len(v) == len(rs) else f" ({len(v)} of {len(rs)})") if v else "never"
                for v in reached.values()) + " |")
        ax.set(xlabel="epoch", ylabel="test accuracy % (mean over seeds, band: their range)", title=task)
        ax.set_ylim(bottom=max(0, ax.get_ylim()[0]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        tail.set(xlabel="epoch", ylabel="mean test accuracy %", title="second half, means", ylim=(tail_low - 0.5, 100))
        tail.grid(alpha=0.3)
        pngs.append(_save(fig, out, f"learning-{task}.png"))
        md.append("")
    return pngs


HANDLERS = {"volume": volume, "scaling": scaling, "wrapper_overhead": overhead, "shrink_recover": shrink,
            "emulated_cluster": cluster, "learning": learning}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default=None, help="default: <folder of the first file>/report")
    ap.add_argument("--variants", default=None, help="learning: the variants to draw, comma-separated (default: all)")
    args = ap.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.files[0])), "report")
    os.makedirs(out, exist_ok=True)
    md: List[str] = ["# Benchmarks", ""]
    written: Dict[str, List[str]] = {}
    for path in args.files:
        with open(path) as f:
            d = json.load(f)
        kind = d.get("benchmark", d.get("bench"))
        if kind not in HANDLERS:
            print(f"skipping {path}: no known 'benchmark' key ({kind!r})", file=sys.stderr)
            continue
        extra = {"variants": args.variants.split(",")} if kind == "learning" and args.variants else {}
        written[path] = HANDLERS[kind](d, out, md, **extra)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    for path, pngs in written.items():
        for p in pngs:
            print(p)
    print(os.path.join(out, "bench.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
