"""Shrink + recover throughput against a plain tensor copy of the same bytes; prints JSON.

    python benchmarks/bench_shrink.py [--reps 30] [--device cpu|cuda]

For each conv shape and structure, ``shrink`` (gather the kept block of z_i + v_i into a communication
bucket) and ``recover`` (rebuild the full tensor from the bucket) are timed against a copy of the same-size
tensor, the conv weight itself: what a dense exchange pays to pack it into a bucket and to unpack it.
Throughput ratio = copy time / our time (1.0: as fast as a copy; bytes/s of the tensor handled).
``shrink_vs_copy_compact`` is the stricter figure against copying only the compact block's bytes.

Both run as the engine runs them: each layer's ``sparsity.gather_plan`` is computed once (the engine caches
it while masks hold). On CPU every pruned layer then takes the native kernel (``prunex_hvd.engine.sparsity.native``:
one pass each way); on CUDA every structure takes one gather each way, recover gathering
from the bucket slice whose pruned chunks read the bucket's unsent zero tail. On CPU the same cases also run
through ATen alone (``*_aten``: ``gather_plan(use_kernel=False)``, what runs where the kernel cannot be built),
interleaved with the rest. Timings are medians over interleaved repetitions. Target ≥ 0.5 for shrink and
recover against the tensor copy. CPU always; CUDA when a GPU is present (synchronised timings).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from prunex_hvd import sparsity
from prunex_hvd.engine.sparsity import native
from prunex_hvd.engine.buckets import BucketLayout

SHAPES = [(64, 64, 3, 3), (256, 128, 3, 3), (512, 256, 3, 3), (512, 512, 3, 3), (2048, 512, 1, 1)]
SPECS = ["channel:0.5", "filter:0.5", "filter:0.5+channel:0.5", "shape:0.5", "channel:0.3"]


def timed(fn, sync):
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def interleaved_medians(ops, reps, sync):
    """Median seconds of each op, the ops taking turns in every repetition (after one warm-up call each)."""
    for fn in ops.values():
        fn()
    times = {k: [] for k in ops}
    for _ in range(reps):
        for k, fn in ops.items():
            times[k].append(timed(fn, sync))
    return {k: statistics.median(v) for k, v in times.items()}


def packing(idx, plans, device):
    """The engine's compact bucket for these layers (with the zero tail its gathers need) and, per layer, what
    recover gathers from: (bucket rows, index), or None where it recovers otherwise (kernel, or scatter)."""
    tail = 2 * max((p.chunk for p in plans if isinstance(p, sparsity.GatherPlan)), default=0)
    layout = BucketLayout([len(r) * len(c) for r, c in idx], torch.float32, device, 1 << 62, zero_tail=tail)
    gathers = []
    for k, plan in enumerate(plans):
        if not isinstance(plan, sparsity.GatherPlan):
            gathers.append(None)
            continue
        rows, zero_row = layout.chunk_rows(k, plan.chunk)
        gathers.append((rows, plan.slot.masked_fill(plan.slot < 0, zero_row)))
    return layout, gathers


def recover_like_the_engine(w, r, c, view, gather, plan, out=None):
    if gather is not None:
        return sparsity.recover_gather(*gather, w.shape, out=out)
    return sparsity.recover(view, r, c, w.shape, out=out, plan=plan)


def recovered_by(plan) -> str:
    return {sparsity.GatherPlan: "gather", sparsity.KernelPlan: "kernel"}.get(type(plan), "scatter")


class EnginePacking:
    """Conv weights packed into one compact bucket and unpacked, as a consensus round does: plans computed once
    (``use_kernel=False``: ATen's plans only), ``pack()`` shrinks every layer into its slice, ``unpack()`` recovers
    every layer into a preallocated tensor."""

    def __init__(self, ws, idx, device, use_kernel=True):
        self.ws, self.idx = ws, idx
        self.plans = [sparsity.gather_plan(r, c, w.shape, use_kernel=use_kernel) for w, (r, c) in zip(ws, idx)]
        self.layout, self.gathers = packing(idx, self.plans, device)
        self.fulls = [torch.empty_like(w) for w in ws]

    def pack(self):
        for w, (r, c), v, plan in zip(self.ws, self.idx, self.layout.views, self.plans):
            sparsity.shrink_into(w, r, c, v, plan=plan)   # as a round does

    def unpack(self):
        for w, (r, c), v, gth, plan, f in zip(self.ws, self.idx, self.layout.views, self.gathers, self.plans,
                                              self.fulls):
            recover_like_the_engine(w, r, c, v, gth, plan, out=f)

    def check(self, masks):
        self.pack()
        self.unpack()
        for w, f, (rows, cols) in zip(self.ws, self.fulls, masks):
            assert torch.equal(f, sparsity.apply_masks(w, rows, cols))


def engine_and_aten(ws, masks, device):
    """The engine's packing and, on CPU, the same with ATen alone: their ops to interleave, named by suffix."""
    idx = [sparsity.masks_to_indices(rows, cols) for rows, cols in masks]
    runs = {"": EnginePacking(ws, idx, device)}
    if device.type == "cpu":
        runs["_aten"] = EnginePacking(ws, idx, device, use_kernel=False)
    ops = {}
    for suffix, run in runs.items():
        run.check(masks)
        ops[f"shrink{suffix}"], ops[f"recover{suffix}"] = run.pack, run.unpack
    return runs, ops


def ratios(med, copy_in, copy_out) -> dict:
    """Copy time / our time, for the engine and (where measured) ATen alone."""
    out = {}
    for suffix in ("", "_aten"):
        if f"shrink{suffix}" in med:
            out[f"shrink_vs_copy{suffix}"] = med[copy_in] / med[f"shrink{suffix}"]
            out[f"recover_vs_copy{suffix}"] = med[copy_out] / med[f"recover{suffix}"]
    return out


def measure(shape, spec, device, reps):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    w = torch.randn(shape, device=device)
    masks = [sparsity.structured_masks(w, spec)]
    runs, ops = engine_and_aten([w], masks, device)
    engine = runs[""]
    n = engine.layout.total_numel
    src_small, src_full = torch.randn(n, device=device), torch.randn_like(w)
    dst_small, full = torch.empty(n, device=device), torch.empty_like(w)
    ops.update(copy_compact=lambda: dst_small.copy_(src_small), copy_full=lambda: full.copy_(src_full))
    med = interleaved_medians(ops, reps, sync)
    return {"shape": list(shape), "spec": spec, "compact_fraction": n / w.numel(),
            "recover_by": recovered_by(engine.plans[0]), **ratios(med, "copy_full", "copy_full"),
            "shrink_vs_copy_compact": med["copy_compact"] / med["shrink"],
            "shrink_GBps": 4 * n / med["shrink"] / 1e9, "recover_GBps": 4 * w.numel() / med["recover"] / 1e9}


def measure_model(name, spec, device, reps):
    """A whole model's conv weights packed into one flat bucket (as a consensus round does) and unpacked,
    against packing and unpacking them dense."""
    from prunex_hvd.app.models import build
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ws = [p.detach().to(device) for p in build(name, 10, 3).parameters() if p.dim() == 4]
    runs, ops = engine_and_aten(ws, [sparsity.structured_masks(w, spec) for w in ws], device)
    dense = torch.empty(sum(w.numel() for w in ws), device=device)
    dviews = dense.split([w.numel() for w in ws])
    fulls = [torch.empty_like(w) for w in ws]

    def dense_pack():
        for w, v in zip(ws, dviews):
            v.copy_(w.reshape(-1))

    def dense_unpack():
        for v, f in zip(dviews, fulls):
            f.copy_(v.view_as(f))
    ops.update(copy_pack=dense_pack, copy_unpack=dense_unpack)
    med = interleaved_medians(ops, reps, sync)
    return {"model": name, "spec": spec, "conv_MB": 4 * dense.numel() / 1e6,
            "compact_MB": 4 * runs[""].layout.total_numel / 1e6, **ratios(med, "copy_pack", "copy_unpack")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="all", choices=("all", "cpu", "cuda"))
    ap.add_argument("--models", default="resnet18,resnet50", help="whole-model pack/unpack cases ('' for none)")
    args = ap.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if args.device != "all":
        devices = [args.device]
    out = {"benchmark": "shrink_recover", "target_ratio_min": 0.5, "threads": torch.get_num_threads(), "results": {}}
    for dev in devices:
        rows = [measure(s, spec, torch.device(dev), args.reps) for s in SHAPES for spec in SPECS]
        models = [measure_model(m, spec, torch.device(dev), max(3, args.reps // 3))
                  for m in filter(None, args.models.split(",")) for spec in SPECS]
        out["results"][dev] = {
            "cases": rows, "models": models,
            "median_shrink_vs_copy": statistics.median(r["shrink_vs_copy"] for r in rows),
            "median_recover_vs_copy": statistics.median(r["recover_vs_copy"] for r in rows),
            "min_shrink_vs_copy": min(r["shrink_vs_copy"] for r in rows),
            "min_recover_vs_copy": min(r["recover_vs_copy"] for r in rows),
            "median_shrink_vs_copy_compact": statistics.median(r["shrink_vs_copy_compact"] for r in rows),
        }
        if dev == "cpu":
            out["results"][dev]["native"] = native.describe()
        if dev == "cuda":
            out["results"][dev]["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
