"""Inter-node volume of a consensus round, dense vs PruneX, with masks from real training (the paper's Fig. 6).

    python benchmarks/bench_volume.py [--models resnet18,resnet152,wide_resnet50_2] [--rounds 3]
        [--local-steps 2] [--batch-size 4] [--image-size 16] [--out FILE]
    python benchmarks/bench_volume.py --models resnet_small          # smoke run, well under a minute

For each model it launches itself under mpirun (4 ranks = 2 emulated nodes x 2, PRUNEX_RANKS_PER_NODE=2; one
launch per model, so each model's memory is returned before the next) and trains it for real with
``px.DistributedOptimizer`` (channel:0.5, coupled unless ``--no-coupled``; ``--coupled-streams``: residual streams
coupled too; ``--local-steps`` SGD steps per round) on the ``synthetic`` dataset:

* measured: the engine's own per-round bytes (``opt.stats()`` differences: the compact consensus exchange on the
  leaders' group, its dense counterfactual, and everything that crossed a node boundary: masks and residual
  scalars too). The masks freeze after round ``--freeze-round`` (default: the second to last), so the last round
  is the steady state: exactly the requested structure.
* sweep: every rank keeps its node's exact candidate z~_i of the last unfrozen round (the tensor the engine
  projected: captured by wrapping ``prunex_hvd.engine.admm.node_candidate``, whose result is passed on unchanged). For
  every kind (filter, channel, channel-coupled = channel with the producing filters of dropped channels
  dropped too, channel-streams = channel-coupled and one channel set per residual stream, composite =
  filter+channel at the same keep) and keep, each node's masks are
  ``sparsity.coupled_masks`` of its candidate, OR'd over the two nodes as the engine does, and the compact
  count Sum|rows|.|cols| + dense parameters + float buffers is set against the dense count. "frozen" is the
  count of one node's masks alone: what a round sends once the masks are frozen (exactly the requested
  structure, the same for any weights). The engine's own kind at 0.5: its OR count is checked against the bytes it
  sent in that round, and the frozen count against the engine's frozen round.

Prints one JSON document (also written to --out). Byte figures are for float32 under the ring model of
``prunex_hvd.dist.comm.accounting`` (for two nodes exact for any allreduce algorithm: each leader sends its
message once)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import benchjson  # benchmarks/ is the script's own folder, first on sys.path

HERE = os.path.abspath(__file__)
KINDS = ("filter", "channel", "channel-coupled", "channel-streams", "composite")
TARGET = 0.40   # paper, Sec. 5.3.1 / Fig. 6: the compact message "stabilizing at approximately 40%" of dense


def spec_of(kind: str, keep: float) -> str:
    if kind == "composite":
        return f"filter:{keep}+channel:{keep}"
    return f"channel:{keep}" if kind.startswith("channel") else f"{kind}:{keep}"


# ------------------------------------------------------------------------------------------------- worker

def worker(a) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    import prunex_hvd as px
    from prunex_hvd import sparsity
    from prunex_hvd.app import models
    from prunex_hvd.engine import admm, dependencies
    from prunex_hvd.dist.comm.accounting import ring_cross_node_bytes
    from prunex_hvd.app.data import ShardedLoader, load_dataset
    from prunex_hvd.dist.runtime import state

    t_start = time.perf_counter()
    topo = px.init(backend="auto")
    _, control = state()
    hosts = control.allgather_object(os.uname().nodename)
    threads = max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
                  // hosts.count(os.uname().nodename))
    torch.set_num_threads(threads)

    data = load_dataset("synthetic", image_size=a.image_size, seed=0)
    torch.manual_seed(0)
    model = models.build(a.model, num_classes=data.num_classes, in_channels=data.in_channels)
    loader = ShardedLoader(data, a.batch_size, topo.rank, topo.size, seed=0, train=True)
    base = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9, weight_decay=5e-4)
    freeze_round = a.freeze_round if a.freeze_round > 0 else None
    # the paper's round restarting at z, as these volumes were measured: each layer keeps its own channel count
    # (the sweep's kinds, which the check compares with), every rank steps alone, no lr warm-up
    opt = px.DistributedOptimizer(base, model, px.ConsensusConfig.paper(restart="global"), sparsity="channel:0.5",
                                  local_steps=a.local_steps, rho1=a.rho1, rho2=a.rho2, freeze_round=freeze_round,
                                  freeze_patience=10**6, coupled=a.coupled, payload_dtype=a.payload_dtype)
    couplings = dependencies.channel_couplings(model)
    streams = dependencies.channel_streams(model)

    # The node candidate z~_i of each round, in entry (= named_parameters) order; kept for the last unfrozen
    # round. Every rank of a node computes the same candidate (the intra sum is an allreduce).
    captured = {"on": False, "now": [], "last": None, "round": None}
    original = admm.node_candidate

    def capturing(*args, **kwargs):
        out = original(*args, **kwargs)
        if captured["on"]:
            captured["now"].append(out)
        return out
    admm.node_candidate = capturing

    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    float_buffers = sum(b.numel() for _, b in model.named_buffers() if b.is_floating_point())
    structured = sparsity.resolve_specs(model.named_parameters(), "channel:0.5")   # every conv weight
    dense_param_numel = sum(p.numel() for n, p in params.items() if n not in structured)
    dense_numel = sum(p.numel() for p in params.values()) + float_buffers

    rounds, step, last_stats = [], 0, opt.stats()
    train_t0 = time.perf_counter()
    batches = iter(())
    epoch = 0
    while len(rounds) < a.rounds:
        captured["on"], captured["now"] = not last_stats["frozen"], []
        t0 = time.perf_counter()
        for _ in range(a.local_steps):   # the last step's opt.step() runs the round
            x_y = next(batches, None)
            if x_y is None:
                loader.set_epoch(epoch)
                epoch += 1
                batches = loader.batches()
                x_y = next(batches)
            x, y = x_y
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            step += 1
        seconds = time.perf_counter() - t0
        stats = opt.stats()
        assert stats["rounds"] == len(rounds) + 1, "one round per local_steps steps"
        if captured["on"]:
            assert len(captured["now"]) == len(names)
            captured["last"], captured["round"] = captured["now"], stats["rounds"]
        captured["now"] = []
        d = {k: stats[k] - last_stats[k] for k in ("inter_bytes", "inter_consensus_bytes", "dense_inter_bytes")}
        rounds.append({"round": stats["rounds"], "masks_frozen": bool(last_stats["frozen"]),
                       "loss": float(loss), **d, "density": stats["density"], "mask_drift": stats["mask_drift"],
                       "seconds": seconds})
        last_stats = stats
    admm.node_candidate = original
    train_seconds = time.perf_counter() - train_t0

    # ---- the sweep: masks of this node's real candidate, split over the node's ranks --------------------
    sweep_t0 = time.perf_counter()
    specs = [(kind, keep) for kind in KINDS for keep in a.keeps]
    cand = {} if captured["last"] is None else {n: t for n, t in zip(names, captured["last"]) if n in structured}
    mine = {}
    for i, (kind, keep) in enumerate(specs):
        if i % topo.local_size != topo.local_rank or not cand:
            continue
        spec = sparsity.parse_spec(spec_of(kind, keep))
        masks = sparsity.coupled_masks(cand, {n: spec for n in structured},
                                       couplings if kind in ("channel-coupled", "channel-streams") else {},
                                       streams if kind == "channel-streams" else ())
        packed = [(np.packbits(masks[n][0].numpy()), np.packbits(masks[n][1].numpy())) for n in structured]
        mine[(kind, keep)] = packed
    captured = cand = None
    gathered = control.allgather_object((topo.node, topo.rank, mine))
    sweep_seconds = time.perf_counter() - sweep_t0

    # ---- job totals over every rank ---------------------------------------------------------------------
    per_rank = control.allgather_object({k: last_stats[k] for k in
                                         ("inter_bytes", "intra_bytes", "inter_consensus_bytes", "dense_inter_bytes")})
    rounds_by_rank = control.allgather_object([{k: r[k] for k in ("inter_bytes", "inter_consensus_bytes",
                                                                  "dense_inter_bytes")} for r in rounds])
    if topo.rank != 0:
        return

    # OR the nodes' masks for every spec; count the compact block
    by_spec = {}
    for node, rank, m in gathered:
        for key, packed in m.items():
            by_spec.setdefault(key, {})[node] = packed   # one rank per node computed each spec
    shapes = {n: (params[n].shape[0], params[n].numel() // params[n].shape[0]) for n in structured}

    def count(packed_by_node, nodes):
        total = 0
        for li, n in enumerate(structured):
            r_n, c_n = shapes[n]
            rows = np.zeros(r_n, dtype=bool)
            cols = np.zeros(c_n, dtype=bool)
            for node in nodes:
                pr, pc = packed_by_node[node][li]
                rows |= np.unpackbits(pr, count=r_n).astype(bool)
                cols |= np.unpackbits(pc, count=c_n).astype(bool)
            total += int(rows.sum()) * int(cols.sum())
        return total + dense_param_numel + float_buffers

    sweep = {kind: {} for kind in KINDS}
    counts = {}
    for (kind, keep), packed_by_node in sorted(by_spec.items()):
        nodes = sorted(packed_by_node)
        or_numel = count(packed_by_node, nodes)
        frozen_numel = count(packed_by_node, nodes[:1])
        per_node = [count(packed_by_node, [nd]) for nd in nodes]
        assert len(set(per_node)) == 1, "one node's structure has a fixed size"
        counts[(kind, keep)] = (or_numel, frozen_numel)
        sweep[kind][str(keep)] = {"or": round(or_numel / dense_numel, 4), "frozen": round(frozen_numel / dense_numel, 4)}

    # checks against what the engine itself sent
    itemsize = 4
    unfrozen = [r for r in rounds if not r["masks_frozen"]]
    frozen_rounds = [r for r in rounds if r["masks_frozen"]]
    engine_kind = {False: "channel", True: "channel-coupled", "streams": "channel-streams"}[a.coupled]
    check = {"spec": "channel:0.5", "coupled": a.coupled}
    if ((engine_kind, 0.5) in counts) and unfrozen:
        last = unfrozen[-1]
        offline = counts[(engine_kind, 0.5)][0] * itemsize
        check.update({"round": last["round"], "what": "OR of the two nodes' masks of the round's candidates",
                      "offline_bytes_per_leader": offline,
                      "engine_bytes_per_leader": last["inter_consensus_bytes"],
                      "difference_bytes": offline - last["inter_consensus_bytes"],
                      "equal": offline == last["inter_consensus_bytes"]})
        if frozen_rounds:
            offline_frozen = counts[(engine_kind, 0.5)][1] * itemsize
            check["frozen"] = {"round": frozen_rounds[-1]["round"], "offline_bytes_per_leader": offline_frozen,
                               "engine_bytes_per_leader": frozen_rounds[-1]["inter_consensus_bytes"],
                               "equal": offline_frozen == frozen_rounds[-1]["inter_consensus_bytes"]}

    def job(key, i=None):   # summed over every rank: the whole run, or round i
        if i is None:
            return sum(r[key] for r in per_rank)
        return sum(r[i][key] for r in rounds_by_rank)

    measured = []
    for i, r in enumerate(rounds):
        cb, db = r["inter_consensus_bytes"], r["dense_inter_bytes"]
        measured.append({"round": r["round"], "masks_frozen": r["masks_frozen"],
                         "message_bytes_per_leader": cb, "message_MiB_per_leader": round(cb / 2**20, 3),
                         "dense_bytes_per_leader": db, "dense_MiB_per_leader": round(db / 2**20, 3),
                         "ratio": round(cb / db, 4),
                         "job_consensus_bytes": job("inter_consensus_bytes", i),
                         "job_dense_bytes": job("dense_inter_bytes", i),
                         "job_all_inter_bytes": job("inter_bytes", i),
                         "density": round(r["density"], 4), "mask_drift": round(r["mask_drift"], 4),
                         "loss": round(r["loss"], 4), "seconds": round(r["seconds"], 2)})

    n_params = sum(p.numel() for p in params.values())
    nodes_of = [gathered[k][0] for k in range(topo.size)]   # gathered is in rank order
    ddp_step = sum(ring_cross_node_bytes("allreduce", [n_params * itemsize] * topo.size, k, nodes_of)
                   for k in range(topo.size))
    run = {"rounds": len(rounds), "steps": step,
           "prunex_consensus_bytes": job("inter_consensus_bytes"),
           "prunex_all_inter_bytes": job("inter_bytes"),
           "dense_consensus_bytes": job("dense_inter_bytes"),
           "ratio_consensus": round(job("inter_consensus_bytes") / job("dense_inter_bytes"), 4),
           "ratio_all_inter": round(job("inter_bytes") / job("dense_inter_bytes"), 4),
           "ddp_gradient_allreduce_bytes": ddp_step * step,
           "note": "job totals (all ranks) over the measured rounds; 'dense' = the same rounds exchanging the "
                   "dense model (what prunex-flat's consensus or a dense round sends); 'all_inter' adds the "
                   "mask OR and residual scalars; 'ddp' = a flat world-ring gradient allreduce every step "
                   "over the same steps (the ledger's ring model), for scale only: with --local-steps this "
                   "small it says little about a real run's local_steps"}

    target = {}
    for kind in KINDS:
        ent = sweep[kind].get("0.5")
        if ent:
            target[kind] = {"ratio_frozen": ent["frozen"], "meets_frozen": ent["frozen"] <= TARGET,
                            "ratio_or_this_run": ent["or"], "meets_or_this_run": ent["or"] <= TARGET}

    out = {"model": a.model, "params": n_params, "conv_params": sum(params[n].numel() for n in structured),
           "dense_params_unstructured": dense_param_numel, "float_buffer_elems": float_buffers,
           "dense_numel_per_round": dense_numel, "dense_MiB_per_round": round(dense_numel * itemsize / 2**20, 2),
           "train": {"ranks": topo.size, "nodes": topo.num_nodes, "launcher": topo.launcher,
                     "dataset": f"synthetic {a.image_size}x{a.image_size}", "batch_size": a.batch_size,
                     "local_steps": a.local_steps, "rounds": a.rounds, "freeze_round": freeze_round,
                     "sparsity": "channel:0.5", "coupled": a.coupled, "coupled_pairs": len(couplings),
                     "coupled_streams": len(streams) if a.coupled == "streams" else 0,
                     "lr": a.lr, "rho1": a.rho1, "rho2": a.rho2, "payload_dtype": a.payload_dtype,
                     "threads_per_rank": threads, "train_seconds": round(train_seconds, 1),
                     "sweep_seconds": round(sweep_seconds, 1),
                     "candidate_round": check.get("round")},
           "measured_rounds": measured, "sweep": sweep, "check": check, "run_totals": run,
           "target_keep_0.5": target, "wall_s": round(time.perf_counter() - t_start, 1)}
    print("BENCH_JSON " + json.dumps(out), flush=True)


# --------------------------------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet18,resnet152,wide_resnet50_2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=16)
    ap.add_argument("--freeze-round", type=int, default=-1,
                    help="masks freeze after this round (the following rounds send exactly the requested "
                         "structure); default rounds-1; 0: never")
    ap.add_argument("--keeps", default="0.3,0.5,0.7,0.9")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--rho1", type=float, default=0.01, help="the CLI's default (the paper's 1.5e-3 needs ~60 rounds)")
    ap.add_argument("--rho2", type=float, default=0.01)
    c = ap.add_mutually_exclusive_group()
    c.add_argument("--no-coupled", dest="coupled", action="store_false",
                   help="run the engine with per-layer channel pruning (the sweep shows every kind either way)")
    c.add_argument("--coupled-streams", dest="coupled", action="store_const", const="streams",
                   help="run the engine with coupled='streams': residual streams coupled as well as pairs")
    ap.add_argument("--payload-dtype", default=None, choices=("fp32", "bf16", "fp16"),
                    help="the inter-node exchange's payload (default: the model's dtype; run_totals then count it)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per model launch")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.keeps = [float(k) for k in a.keeps.split(",")]
    if a.freeze_round < 0:
        a.freeze_round = a.rounds - 1
    if a.worker:
        worker(a)
        return

    env = dict(os.environ, PRUNEX_RANKS_PER_NODE="2", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               OMPI_MCA_btl="self,vader,tcp", OMPI_MCA_btl_tcp_if_include="lo", OMPI_MCA_oob_tcp_if_include="lo",
               OMPI_MCA_mpi_yield_when_idle="1")   # 4 ranks on few cores: waiting ranks yield the CPU
    t0 = time.perf_counter()
    results = {}
    for model in a.models.split(","):
        cmd = ["mpirun", "--oversubscribe", "-np", "4", "-x", "PRUNEX_RANKS_PER_NODE", sys.executable, HERE,
               "--worker", "--model", model, "--rounds", str(a.rounds), "--local-steps", str(a.local_steps),
               "--batch-size", str(a.batch_size), "--image-size", str(a.image_size),
               "--freeze-round", str(a.freeze_round), "--keeps", ",".join(map(str, a.keeps)),
               "--lr", str(a.lr), "--rho1", str(a.rho1), "--rho2", str(a.rho2)] + \
            {False: ["--no-coupled"], True: [], "streams": ["--coupled-streams"]}[a.coupled] + \
            (["--payload-dtype", a.payload_dtype] if a.payload_dtype else [])
        t_model = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("BENCH_JSON ")), None)
        if proc.returncode or line is None:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            sys.exit(proc.returncode or 1)
        results[model] = json.loads(line[len("BENCH_JSON "):])
        results[model]["launch_wall_s"] = round(time.perf_counter() - t_model, 1)
        print(f"[bench_volume] {model}: {results[model]['launch_wall_s']} s", file=sys.stderr, flush=True)

    doc = {"benchmark": "volume",
           "setup": "4 ranks = 2 emulated nodes x 2 under mpirun; real px.DistributedOptimizer training, channel:0.5"
                    + {False: "", True: " coupled (a conv's dropped input channels drop their producer's filters)",
                       "streams": " coupled, residual streams too (coupled='streams')"}[a.coupled],
           "target": f"<= {TARGET:.2f}x dense at keep 0.5 (paper, Sec. 5.3.1 / Fig. 6: the compact message "
                     f"stabilises at ~40% of dense, a ~60% cut)",
           "reading": "sweep ratios are compact/dense elements of one consensus message per leader; 'or' = the "
                      "OR of the two nodes' masks of this short run's last unfrozen round (what a round sends "
                      "while masks move), 'frozen' = exactly the requested structure (what every round sends "
                      "once masks are frozen). Channel or filter keep 0.5 keeps half of every conv plus the "
                      "dense BN/FC/buffers, so ~0.5x is the floor for them; channel-coupled also drops the filters "
                      "that produce dropped channels (inside residual blocks), channel-streams also the filters "
                      "writing into a residual stream; composite keeps ~a quarter.",
           "models": results, "wall_s": round(time.perf_counter() - t0, 1),
           "host": {"cpus": os.cpu_count(), "load_avg_at_end": [round(x, 1) for x in os.getloadavg()]}}
    benchjson.emit(doc, a.out)


if __name__ == "__main__":
    main()
