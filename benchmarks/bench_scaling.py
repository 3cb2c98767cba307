"""Strong scaling 8 -> 64 GPUs of dense, topk, pactrain, the round-based rivals and prunex: an alpha-beta model.

    python benchmarks/bench_scaling.py [--models resnet18,resnet152,wide_resnet50_2] [--volume VOLUME.json]
        [--step-seconds resnet18=0.04,...  --step-batch 128] [--global-batch 1024] [--local-steps 49] [--out FILE]

Time of one global step on N GPUs (N/G nodes of G GPUs) with the global batch fixed (strong scaling: each GPU
computes global_batch/N samples, so compute shrinks with N and communication does not):

    T(N) = t_compute(global_batch/N) + t_extra + t_comm(N)        speedup(N) = T(8) / T(N)   (ideal: N/8)

* compute: the time of one local step (forward + backward + SGD-with-momentum step) at a reference batch, scaled
  linearly in the batch. Sources (one scenario each): measured here on CPU (``--measure-batch``, 32x32 input, all
  cores; on by default), ``--step-seconds`` (e.g. a GPU measurement at ``--step-batch``), and the paper's setting
  with an ASSUMED V100 figure (ResNet-18 CIFAR step at batch 128 = ``--v100-r18-step`` s, other models scaled by
  their counted forward FLOPs at 32x32).
* communication, alpha-beta (alpha per message hop, bytes / bandwidth), a collective on a ring of n members with
  the slowest link as bottleneck: allreduce 2(n-1)(alpha + S/(n.bw)); allgather of s per member (n-1)(alpha + s/bw);
  broadcast as a pipelined chain (n-1).alpha + S/bw. A flat ring over GPUs of several nodes runs at the
  inter-node link (one NIC per node; with contiguous ranks exactly one ring edge leaves and one enters a node).
  - dense: flat ring allreduce of every fp32 gradient, every step (DDP / NCCL ring; no overlap with backward);
  - topk: two flat ring allgathers a step, values (fp32) and indices (int32) of ratio.P gradients per GPU
    (the selection's own cost is not modelled);
  - pactrain: flat ring allreduce of the kept gradients, every step (steady state: mask stable; no TernGrad);
  - localsgd, diloco: every local_steps steps, a flat ring allreduce of the parameters and one of the float
    buffers (DiLoCo's outer step is local);
  - localsgd-hier: the same, plus an intra-node allreduce of the parameters every local_steps/4 steps (the
    default node period: the largest divisor of local_steps not above a quarter of it);
  - prunex-flat: every local_steps steps, a flat ring allreduce of dense theta+u (params + float buffers);
  - prunex: every local_steps steps, intra-node allreduce of dense theta+u (NVLink), the leaders' ring allreduce
    of the compact message (inter-node), a compact intra-node broadcast, and the residual scalars (3 small
    collectives); masks frozen (steady state): no mask OR. The compact message in ``--payload-bytes`` per
    value (4: float32; 2: the CLI's bf16 recipe);
  - prunex-overlap (``overlap=True``): the same round, but the leaders' compact allreduce runs while the next
    round's local_steps steps compute: only max(0, its time - the round's compute) is exposed; the intra-node
    parts and the residual scalars stay blocking.
  The per-round cost of prunex/prunex-flat is spread over the local_steps steps of the round.
* t_extra, the per-step element-wise work a method adds that does not shrink with N, as memory passes over
  fp32 tensors at a memory bandwidth (on CPU: PruneX's extras timed after each measured step; --mem-gbs
  otherwise): prunex and prunex-flat (steady state, masked retraining) 6 passes over all parameters (two
  fused adds of the proximal gradient) + 6 over the conv weights (gradient and weight masked); pactrain 3
  over the conv weights (gradient masked) + 4 over the kept gradients (pack and unpack the compact buffer).
  Approximate pass counts; topk's selection and everything else not modelled.

Prints JSON: per scenario, model, method and N the modelled speedup (and time per step), plus "assumptions",
every number used and where it came from."""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import benchjson  # benchmarks/ is the script's own folder, first on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

METHODS = ("dense", "topk", "pactrain", "localsgd", "localsgd-hier", "diloco", "prunex-flat", "prunex",
           "prunex-overlap")
SIZE_KEYS = ("params", "conv_params", "float_buffers", "dense_numel", "compact_ratio", "compact_ratio_source",
             "compact_ratio_from_shapes", "compact_ratio_pre_freeze_or", "pactrain_kept", "fwd_gflops_per_image")
PAPER_SPEEDUP_64 = {"prunex": 6.75, "dense": 5.81, "topk": 3.71}   # Sec. 5.4 / Fig. 9, ResNet-152 (measured there)


# ------------------------------------------------------------------------------------------- model facts

def model_facts(name: str, spec: str, image_size: int = 32) -> dict:
    """Counts from a real build: parameters, float buffers, the frozen structure's compact size, forward FLOPs."""
    import torch
    from torch import nn

    from prunex_hvd import sparsity
    from prunex_hvd.app import models

    torch.manual_seed(0)
    model = models.build(name, num_classes=10, in_channels=3)
    params = dict(model.named_parameters())
    specs = sparsity.resolve_specs(model.named_parameters(), spec)
    kept_conv = 0
    for n, s in specs.items():
        rows, cols = sparsity.structured_masks(params[n], s)
        kept_conv += int(rows.sum()) * int(cols.sum())
    dense_unstructured = sum(p.numel() for n, p in params.items() if n not in specs)
    buffers = sum(b.numel() for _, b in model.named_buffers() if b.is_floating_point())
    n_params = sum(p.numel() for p in params.values())

    macs = [0]

    def conv_hook(m, inp, out):
        macs[0] += out.numel() * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]

    def lin_hook(m, inp, out):
        macs[0] += out.numel() * m.in_features
    hooks = [m.register_forward_hook(conv_hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    hooks += [m.register_forward_hook(lin_hook) for m in model.modules() if isinstance(m, nn.Linear)]
    model.eval()
    with torch.no_grad():
        model(torch.zeros(1, 3, image_size, image_size))
    for h in hooks:
        h.remove()
    return {"params": n_params, "float_buffers": buffers, "conv_params": sum(params[n].numel() for n in specs),
            "kept_conv": kept_conv, "dense_unstructured": dense_unstructured,
            "entries": len(params), "fwd_gflops_per_image": 2 * macs[0] / 1e9}


def measure_step(name: str, batch: int, image_size: int, reps: int):
    """On this CPU, the median seconds of one local step (zero_grad, forward, backward, SGD momentum step), and
    the memory bandwidth of PruneX's per-step extras timed right after each step (the proximal gradient's two
    fused adds over every parameter, the masked-retraining multiplies of conv gradients and weights), in
    bytes/s: the extras' own cost and the bandwidth the other methods' extras are charged at."""
    import torch
    import torch.nn.functional as F

    from prunex_hvd.app import models

    torch.manual_seed(0)
    model = models.build(name, num_classes=10, in_channels=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(batch, 3, image_size, image_size)
    y = torch.randint(0, 10, (batch,))
    params = list(model.parameters())
    shifts = [torch.zeros_like(p) for p in params]
    convs = [p for p in params if p.dim() == 4]
    masks = [torch.ones_like(p) for p in convs]
    moved = 4 * (6 * sum(p.numel() for p in params) + 6 * sum(p.numel() for p in convs))
    times, extras = [], []
    for i in range(reps + 1):   # the first is a warm-up
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        t1 = time.perf_counter()
        with torch.no_grad():
            grads = [p.grad for p in params]
            torch._foreach_add_(grads, params, alpha=1e-3)
            torch._foreach_add_(grads, shifts)
            torch._foreach_mul_([p.grad for p in convs], masks)
            torch._foreach_mul_(convs, masks)
        t2 = time.perf_counter()
        if i:
            times.append(t1 - t0)
            extras.append(t2 - t1)
    return statistics.median(times), moved / statistics.median(extras)


# ------------------------------------------------------------------------------------------ alpha-beta

def allreduce(n, nbytes, alpha, bw):
    return 0.0 if n <= 1 else 2 * (n - 1) * (alpha + nbytes / (n * bw))


def allgather(n, block_bytes, alpha, bw):
    return 0.0 if n <= 1 else (n - 1) * (alpha + block_bytes / bw)


def broadcast(n, nbytes, alpha, bw):
    return 0.0 if n <= 1 else (n - 1) * alpha + nbytes / bw


def comm_per_step(method, N, G, f, a, step_s: float = 0.0) -> float:
    """Seconds of communication per global step for ``method`` on N GPUs, G per node; ``step_s``: one local
    step's compute (what prunex-overlap hides its inter-node exchange behind)."""
    M = N // G
    inter = (a.alpha_inter, a.inter_gbps * 1e9 / 8)     # bytes/s
    intra = (a.alpha_intra, a.intra_gbs * 1e9)
    flat = inter if M > 1 else intra                    # a flat ring runs at its slowest link
    grads = 4 * f["params"]
    if method == "dense":
        return allreduce(N, grads, *flat)
    if method == "topk":
        k = math.ceil(a.topk_ratio * f["params"])
        return allgather(N, 4 * k, *flat) + allgather(N, 4 * k, *flat)
    if method == "pactrain":
        return allreduce(N, 4 * f["pactrain_kept"], *flat)
    if method in ("localsgd", "localsgd-hier", "diloco"):
        per_round = allreduce(N, grads, *flat) + allreduce(N, 4 * f["float_buffers"], *flat)
        if method == "localsgd-hier":
            intra_period = max(d for d in range(1, max(1, a.local_steps // 4) + 1) if a.local_steps % d == 0)
            per_round += (a.local_steps // intra_period - 1) * allreduce(G, grads, *intra)
        return per_round / a.local_steps
    residual = 3 * 8 * f["entries"]                     # float64 r/s per layer
    if method == "prunex-flat":
        per_round = allreduce(N, 4 * f["dense_numel"], *flat) + allreduce(N, residual, *flat)
        return per_round / a.local_steps
    if method in ("prunex", "prunex-overlap"):
        compact = a.payload_bytes * f["compact_numel"]
        exchange = allreduce(M, compact, *inter)                          # leaders, compact
        if method == "prunex-overlap":                                    # behind the next round's steps
            exchange = max(0.0, exchange - a.local_steps * step_s)
        per_round = (allreduce(G, 4 * f["dense_numel"], *intra)          # intra sum of theta + u
                     + exchange
                     + broadcast(G, compact, *intra)                      # compact z to the node
                     + allreduce(G, residual, *intra) + allreduce(M, residual, *inter)
                     + broadcast(G, residual, *intra))
        return per_round / a.local_steps
    raise ValueError(method)


def extra_per_step(method, f, mem_bw: float) -> float:
    engine = 6 * f["params"] + 6 * f["conv_params"]     # prunex-flat is the same engine with one flat group
    passes = {"prunex": engine, "prunex-flat": engine, "prunex-overlap": engine,
              "pactrain": 3 * f["conv_params"] + 4 * f["pactrain_kept"]}.get(method, 0)
    return 4 * passes / mem_bw


def scenario(step_at_ref: dict, ref_batch: int, facts: dict, a, mem_bw) -> dict:
    """``mem_bw``: bytes/s, one number or {model: number}."""
    bw = mem_bw if isinstance(mem_bw, dict) else {m: mem_bw for m in facts}
    out = {}
    for model, f in facts.items():
        if model not in step_at_ref:
            continue
        t_ref = step_at_ref[model]
        res = {"step_seconds": round(t_ref, 5), "at_batch": ref_batch, "per_gpu_batch": {},
               "compute_s": {}, "mem_GBps": round(bw[model] / 1e9, 2),
               "extra_s_per_step": {m: round(extra_per_step(m, f, bw[model]), 6) for m in METHODS},
               "comm_s_per_step": {m: {} for m in METHODS}, "time_per_step_s": {m: {} for m in METHODS},
               "speedup": {m: {} for m in METHODS}, "efficiency": {m: {} for m in METHODS},
               "throughput_vs_dense_8": {m: {} for m in METHODS}}
        for N in a.gpus:
            b = a.global_batch / N
            res["per_gpu_batch"][N] = b
            res["compute_s"][N] = round(t_ref * b / ref_batch, 6)
        dense8 = None
        for m in METHODS:
            T = {}
            for N in a.gpus:
                step_s = t_ref * (a.global_batch / N) / ref_batch + extra_per_step(m, f, bw[model])
                c = comm_per_step(m, N, a.gpus_per_node, f, a, step_s)
                T[N] = step_s + c
                res["comm_s_per_step"][m][N] = round(c, 6)
                res["time_per_step_s"][m][N] = round(T[N], 6)
            base = T[a.gpus[0]]
            if m == "dense":
                dense8 = base
            for N in a.gpus:
                res["speedup"][m][N] = round(base / T[N], 3)
                res["efficiency"][m][N] = round(base / T[N] / (N / a.gpus[0]), 3)
        for m in METHODS:
            for N in a.gpus:
                res["throughput_vs_dense_8"][m][N] = round(dense8 / res["time_per_step_s"][m][N], 3)
        out[model] = res
    return out


def volume_ratios(path, spec) -> dict:
    """From a bench_volume JSON: {model: {"frozen": ratio of the engine's frozen round (or the sweep's frozen
    count), "or": the sweep's OR ratio of the last unfrozen round}} for ``spec``; {} if the sweep lacks it."""
    with open(path) as f:
        doc = json.load(f)
    from prunex_hvd import sparsity
    parts = sparsity.parse_spec(spec).parts
    kinds = tuple(k for k, _ in parts)
    keeps = {v for _, v in parts}
    kind = {("channel",): "channel", ("filter",): "filter", ("filter", "channel"): "composite"}.get(kinds)
    if kind is None or len(keeps) != 1:
        return {}
    keep = str(keeps.pop())
    out = {}
    for model, d in doc.get("models", {}).items():
        ent = d.get("sweep", {}).get(kind, {}).get(keep)
        if not ent:
            continue
        frozen = [r for r in d.get("measured_rounds", []) if r["masks_frozen"]]
        measured = frozen[-1]["ratio"] if frozen and spec == d.get("train", {}).get("sparsity") else None
        out[model] = {"frozen": measured if measured is not None else ent["frozen"], "or": ent["or"],
                      "frozen_source": "engine's frozen round" if measured is not None else "sweep (frozen)"}
    return out


# ------------------------------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet18,resnet152,wide_resnet50_2")
    ap.add_argument("--gpus", default="8,16,32,64")
    ap.add_argument("--gpus-per-node", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--local-steps", type=int, default=49,
                    help="steps per round: 49 ~ one CIFAR-10 epoch at global batch 1024 (the paper uses 5-10 epochs)")
    ap.add_argument("--sparsity", default="channel:0.5")
    ap.add_argument("--payload-bytes", type=int, default=4, choices=(2, 4),
                    help="bytes per value of prunex's compact inter-node message (2: the CLI's bf16 recipe)")
    ap.add_argument("--topk-ratio", type=float, default=0.01)
    ap.add_argument("--volume", default=None, help="bench_volume JSON: take the compact ratio measured there")
    ap.add_argument("--step-seconds", default=None, help="MODEL=S,... local step seconds at --step-batch")
    ap.add_argument("--step-batch", type=int, default=128)
    ap.add_argument("--no-measure", action="store_true", help="skip timing steps on this CPU")
    ap.add_argument("--measure-batch", type=int, default=4)
    ap.add_argument("--measure-reps", type=int, default=3)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--v100-r18-step", type=float, default=0.04)
    ap.add_argument("--v100-batch", type=int, default=128)
    ap.add_argument("--mem-gbs", type=float, default=900.0,
                    help="GPU memory GB/s for the per-step element-wise extras (V100 HBM2: 900)")
    ap.add_argument("--intra-gbs", type=float, default=300.0, help="intra-node GB/s per GPU (V100 NVLink)")
    ap.add_argument("--inter-gbps", type=float, default=100.0, help="inter-node Gb/s per node (InfiniBand)")
    ap.add_argument("--alpha-intra", type=float, default=5e-6, help="seconds per intra-node message hop")
    ap.add_argument("--alpha-inter", type=float, default=10e-6, help="seconds per inter-node message hop")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.gpus = [int(n) for n in a.gpus.split(",")]
    if any(n % a.gpus_per_node for n in a.gpus):
        ap.error("every N in --gpus must be a multiple of --gpus-per-node")
    t_start = time.perf_counter()
    import torch

    names = a.models.split(",")
    facts = {m: model_facts(m, a.sparsity, a.image_size) for m in names}
    vol = volume_ratios(a.volume, a.sparsity) if a.volume else {}
    assumptions = [
        f"topology: {a.gpus_per_node} GPUs per node, N in {a.gpus} (the paper: V100 nodes of 4, 8 -> 64 GPUs)",
        f"intra-node bandwidth {a.intra_gbs} GB/s per GPU (V100 NVLink figure as given; it is the aggregate of "
        f"all links both ways, a ring uses less, but intra-node is never the bottleneck here), alpha_intra "
        f"{a.alpha_intra * 1e6:g} us per hop (assumption)",
        f"inter-node bandwidth {a.inter_gbps} Gb/s = {a.inter_gbps / 8:g} GB/s per node, one link per node "
        f"(the paper's HDR InfiniBand, 100 Gb/s per link), alpha_inter {a.alpha_inter * 1e6:g} us per hop (assumption)",
        "ideal links: full bandwidth, no congestion, no compute/communication overlap for any method (DDP overlaps "
        "its allreduce with backward, which would favour dense), no kernel/launch overheads beyond alpha",
        "dense = one flat NCCL-style ring allreduce over all N GPUs of all fp32 gradients every step (not hierarchical)",
        f"topk: {a.topk_ratio:g} of all gradients per GPU, fp32 values + int32 indices, two flat ring allgathers "
        "a step; the cost of selecting the top-k is not modelled (the paper blames it for Top-K's 3.71x)",
        "pactrain: compact allreduce of the kept gradients every step at PruneX's kept fraction (counted from the "
        "model's shapes: conv weights at the spec + every other parameter), mask already stable",
        f"localsgd / diloco / localsgd-hier: a round every {a.local_steps} steps, a flat ring allreduce of the fp32 "
        "parameters and one of the float buffers; localsgd-hier also averages the parameters within each node "
        "at its default node period; their rounds' local work (DiLoCo's outer step) is not modelled",
        f"prunex / prunex-flat: a round every {a.local_steps} steps (49 ~ one CIFAR-10 epoch at global batch "
        f"{a.global_batch}; the paper runs 5-10 local epochs per round, which would make rounds rarer still); "
        "the round's own compute (candidate, projection, recovery, duals) not modelled; prunex's masks frozen "
        "(no mask OR); the compact message at --payload-bytes "
        f"{a.payload_bytes} per value; prunex-overlap exposes only what of the leaders' compact allreduce outlasts "
        "the next round's local steps (overlap=True), the rest of its round as prunex",
        "per-step element-wise extras (not shrinking with N): prunex and prunex-flat 6 passes over all fp32 "
        "parameters (proximal gradient: two fused adds) + 6 over the conv weights (masked retraining: gradient "
        "and weight masked); pactrain 3 over the conv weights + 4 over the kept gradients; at the scenario's "
        "memory bandwidth (approximate pass counts)",
        f"strong scaling: global batch {a.global_batch} fixed, per-GPU batch global/N; compute time linear in the "
        "per-GPU batch (optimistic at small batches, where GPUs are less efficient)",
        "CIFAR models at 32x32 input, 10 classes (the project's builds); forward FLOPs counted by hooks on conv "
        "and linear layers",
    ]
    for m, f in facts.items():
        f["pactrain_kept"] = f["kept_conv"] + f["dense_unstructured"]
        f["dense_numel"] = f["params"] + f["float_buffers"]
        shape_ratio = (f["kept_conv"] + f["dense_unstructured"] + f["float_buffers"]) / f["dense_numel"]
        if m in vol:
            f["compact_ratio"] = vol[m]["frozen"]
            f["compact_ratio_source"] = f"measured by bench_volume ({vol[m]['frozen_source']}, {a.volume})"
            f["compact_ratio_pre_freeze_or"] = vol[m]["or"]
        else:
            f["compact_ratio"] = round(shape_ratio, 4)
            f["compact_ratio_source"] = (f"counted from the model's shapes: the frozen {a.sparsity} structure keeps "
                                         f"exactly ceil(keep*groups) per conv, plus every dense parameter and "
                                         f"float buffer (rounds before freezing send the OR of the nodes' masks: "
                                         f"more; bench_volume measures it)")
        f["compact_ratio_from_shapes"] = round(shape_ratio, 4)
        f["compact_numel"] = round(f["compact_ratio"] * f["dense_numel"])
        assumptions.append(f"{m}: {f['params']:,} params, {f['float_buffers']:,} float buffer elements, "
                           f"{f['fwd_gflops_per_image']:.3f} forward GFLOPs/image at {a.image_size}x{a.image_size}; "
                           f"prunex compact ratio {f['compact_ratio']} ({f['compact_ratio_source']}); pactrain kept "
                           f"fraction {f['pactrain_kept'] / f['params']:.4f} of the gradients")

    scenarios, sources = {}, {}
    if not a.no_measure:
        torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
        both = {m: measure_step(m, a.measure_batch, a.image_size, a.measure_reps) for m in names}
        measured = {m: v[0] for m, v in both.items()}
        cpu_bw = {m: v[1] for m, v in both.items()}
        sources["measured_here_cpu"] = (measured, a.measure_batch, cpu_bw)
        assumptions.append(f"measured_here_cpu: step seconds measured on this host ({torch.get_num_threads()} "
                           f"threads, shared with other work; median of {a.measure_reps} after a warm-up) at batch "
                           f"{a.measure_batch}, {a.image_size}x{a.image_size}: "
                           + ", ".join(f"{m} {s:.3f} s" for m, s in measured.items())
                           + "; memory bandwidth of PruneX's per-step extras timed after each of those steps: "
                           + ", ".join(f"{m} {b / 1e9:.2f} GB/s" for m, b in cpu_bw.items()) + ". CPU "
                           "compute dwarfs a GPU cluster's links, so this scenario scales near ideally")
    if a.step_seconds:
        given = {kv.split("=")[0]: float(kv.split("=")[1]) for kv in a.step_seconds.split(",")}
        sources["given_step_seconds"] = (given, a.step_batch, a.mem_gbs * 1e9)
        assumptions.append(f"given_step_seconds: --step-seconds {a.step_seconds} at batch {a.step_batch} (user input), "
                           f"memory bandwidth --mem-gbs {a.mem_gbs} GB/s")
    r18 = facts.get("resnet18") or model_facts("resnet18", a.sparsity, a.image_size)
    v100 = {m: a.v100_r18_step * f["fwd_gflops_per_image"] / r18["fwd_gflops_per_image"] for m, f in facts.items()}
    sources["paper_setting_v100_assumed"] = (v100, a.v100_batch, a.mem_gbs * 1e9)
    assumptions.append(f"paper_setting_v100_assumed: ASSUMED (not measured) V100 step of CIFAR ResNet-18 at batch "
                       f"{a.v100_batch} = {a.v100_r18_step} s (fwd+bwd+SGD, fp32); other models scaled by forward "
                       f"FLOPs: " + ", ".join(f"{m} {s:.3f} s" for m, s in v100.items())
                       + f"; memory bandwidth {a.mem_gbs} GB/s (V100 HBM2 spec, assumption)")

    # What a round costs when it is not amortised: prunex and prunex-flat with a round every step.
    every_step = argparse.Namespace(**dict(vars(a), local_steps=1))
    for sc, (steps, batch, mem_bw) in sources.items():
        scenarios[sc] = res = scenario(steps, batch, facts, a, mem_bw)
        once = scenario(steps, batch, facts, every_step, mem_bw)
        for m, r in res.items():
            r["round_every_step"] = {meth: {"speedup": once[m]["speedup"][meth],
                                            "comm_s_per_step": once[m]["comm_s_per_step"][meth]}
                                     for meth in ("prunex-flat", "prunex", "prunex-overlap")}
    assumptions.append("round_every_step: prunex and prunex-flat recomputed with local_steps=1 (a round every "
                       "step), to show what the hierarchy and the compact message save per round")

    fig7 = None
    if "resnet152" in facts:   # the paper's measured per-iteration communication latency, ResNet-152, 64 GPUs
        f, N = facts["resnet152"], 64
        fig7 = {"modelled_dense_comm_s_per_step": round(comm_per_step("dense", N, a.gpus_per_node, f, a), 4),
                "paper_measured_dense_s": 0.50,
                "modelled_prunex_comm_s_per_round": round(comm_per_step("prunex", N, a.gpus_per_node, f, every_step), 4),
                "paper_measured_prunex_s": 0.10,
                "note": "the alpha-beta links are ideal: the paper's measured latencies (Fig. 7) are several times "
                        "the model's, so the modelled speedups are not a prediction of the paper's figures"}

    short = {sc: {m: {meth: r["speedup"][meth][a.gpus[-1]] for meth in METHODS} for m, r in res.items()}
             for sc, res in scenarios.items()}
    doc = {"benchmark": "scaling", "kind": "alpha-beta model, no launches",
           f"speedup_{a.gpus[0]}_to_{a.gpus[-1]}": short,
           "paper_measured_speedup_8_to_64_resnet152": PAPER_SPEEDUP_64,
           "sizes": {m: {k: f[k] for k in SIZE_KEYS if k in f} for m, f in facts.items()},
           "paper_fig7_check": fig7,
           "scenarios": scenarios, "assumptions": assumptions,
           "wall_s": round(time.perf_counter() - t_start, 1),
           "host": {"cpus": os.cpu_count(), "load_avg_at_end": [round(x, 1) for x in os.getloadavg()]}}
    benchjson.emit(doc, a.out)


if __name__ == "__main__":
    main()
