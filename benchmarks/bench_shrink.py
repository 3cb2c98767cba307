"""Shrink + recover throughput against a plain tensor copy of the same bytes; prints JSON.

    python benchmarks/bench_shrink.py [--reps 30] [--device cpu|cuda]

For each conv shape and structure, ``shrink`` (gather the kept block of z_i + v_i into a communication
bucket) and ``recover`` (zero-fill the full tensor and scatter the block back) are timed against copies
moving the same bytes: shrink against copying a block of the compact size (what a dense pack of that
many values costs), recover against writing the full tensor (zero-fill + copy of that size). Throughput
ratio = copy time / our time (1.0: as fast as a copy). Timings are medians over interleaved repetitions.
Target ≥ 0.5 for both. CPU always; CUDA when a GPU is present (synchronised timings).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from prunex_hvd import sparsity

SHAPES = [(64, 64, 3, 3), (256, 128, 3, 3), (512, 256, 3, 3), (512, 512, 3, 3), (2048, 512, 1, 1)]
SPECS = ["channel:0.5", "filter:0.5", "filter:0.5+channel:0.5", "shape:0.5", "channel:0.3"]


def timed(fn, sync):
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def measure(shape, spec, device, reps):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    w = torch.randn(shape, device=device)
    rows, cols = sparsity.structured_masks(w, spec)
    r_idx, c_idx = sparsity.masks_to_indices(rows, cols)
    n = len(r_idx) * len(c_idx)
    bucket = torch.empty(n, device=device)
    full = torch.empty_like(w)
    src_small, src_full = torch.randn(n, device=device), torch.randn_like(w)
    dst_small = torch.empty(n, device=device)

    ops = {
        "shrink": lambda: sparsity.shrink(w, r_idx, c_idx, out=bucket),
        "copy_compact": lambda: dst_small.copy_(src_small),
        "recover": lambda: sparsity.recover(bucket, r_idx, c_idx, w.shape, out=full),
        "copy_full": lambda: (full.zero_(), full.copy_(src_full)),
    }
    for fn in ops.values():   # warm-up
        fn()
    times = {k: [] for k in ops}
    for _ in range(reps):
        for k, fn in ops.items():
            times[k].append(timed(fn, sync))
    med = {k: statistics.median(v) for k, v in times.items()}
    assert torch.equal(sparsity.recover(sparsity.shrink(w, r_idx, c_idx), r_idx, c_idx, w.shape),
                       sparsity.apply_masks(w, rows, cols))
    return {"shape": list(shape), "spec": spec, "compact_fraction": n / w.numel(),
            "shrink_vs_copy": med["copy_compact"] / med["shrink"],
            "recover_vs_copy": med["copy_full"] / med["recover"],
            "shrink_GBps": 4 * n / med["shrink"] / 1e9, "recover_GBps": 4 * w.numel() / med["recover"] / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="all", choices=("all", "cpu", "cuda"))
    args = ap.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if args.device != "all":
        devices = [args.device]
    out = {"benchmark": "shrink_recover", "target_ratio_min": 0.5, "threads": torch.get_num_threads(), "results": {}}
    for dev in devices:
        rows = [measure(s, spec, torch.device(dev), args.reps) for s in SHAPES for spec in SPECS]
        out["results"][dev] = {
            "cases": rows,
            "median_shrink_vs_copy": statistics.median(r["shrink_vs_copy"] for r in rows),
            "median_recover_vs_copy": statistics.median(r["recover_vs_copy"] for r in rows),
            "min_shrink_vs_copy": min(r["shrink_vs_copy"] for r in rows),
            "min_recover_vs_copy": min(r["recover_vs_copy"] for r in rows),
        }
        if dev == "cuda":
            out["results"][dev]["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
