#!/usr/bin/env bash
# The overlapped round on a GPU host: its correctness tests on CUDA tensors (NCCL, Gloo) and its
# timing, blocking against overlapped, ResNet-18 (digits at 32×32) on 2 emulated nodes × 2 sharing the host's
# GPU over NCCL (each rank its own NCCL host id: NCCL's socket transport over loopback between them, see
# tests/launch/test_engine_launch.py): what an overlapped round costs and hides on a GPU, not a slow link's figures.
#   bash scripts/gpu_overlap.sh OUTDIR        (SKIP_TESTS=1: the timing alone)
# Writes OUTDIR/overlap_tests.log and OUTDIR/overlap_timing.json (the runs' summaries and per-round waits).
source "$(dirname "$0")/gpu_host.sh"

rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/launch/test_engine_launch.py -k "overlapped_cuda" 2>&1 \
        | tee "$out/overlap_tests.log" || rc=1
fi

export PRUNEX_RANKS_PER_NODE=2 NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_SHM_DISABLE=1
bin="$(dirname "$(command -v "$PY")")"
runs=()
for mode in blocking overlap; do
    flag=$([ "$mode" = overlap ] && echo on || echo off)   # every round: the recipe chooses the masks at the start
    rm -rf "$out/run-$mode"
    "$bin/torchrun" --standalone --no-python --nproc_per_node=4 \
        bash -c 'NCCL_HOSTID=prunex-rank$RANK exec "$@"' fake-host \
        "$PY" -m prunex_hvd.app.cli train --model resnet18 --dataset digits --image-size 32 --batch-size 32 \
        --epochs "${EPOCHS:-8}" --lr 0.05 --device cuda --backend nccl --local-steps "${LOCAL_STEPS:-7}" \
        --overlap "$flag" --checkpoint-every 0 \
        --out "$out/run-$mode" > "$out/run-$mode.log" 2>&1 || { rc=1; tail -20 "$out/run-$mode.log"; }
    runs+=("$out/run-$mode")
done
"$PY" - "${runs[@]}" > "$out/overlap_timing.json" <<'PYEOF' || rc=1
import json, sys
doc = {}
for run in sys.argv[1:]:
    s = json.load(open(f"{run}/summary.json"))
    rounds = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"round"' in l]
    doc[run.rsplit("-", 1)[1]] = {k: s.get(k) for k in ("wall_s", "rounds", "final_test_acc", "exchange_wait_s",
                                                          "inter_bytes", "density")} | {
        "exchange_wait_per_round_s": s["exchange_wait_s"] / max(1, s["rounds"]),
        "wall_per_round_s": s["wall_s"] / max(1, s["rounds"]),
        "test_acc_by_record": [r.get("test_acc") for r in rounds], "wall_by_record": [r.get("wall_s") for r in rounds]}
b, o = doc.get("blocking"), doc.get("overlap")
if b and o:
    doc["overlap_over_blocking"] = {"wall": round(o["wall_s"] / b["wall_s"], 3),
                                    "exchange_wait": round(o["exchange_wait_s"] / max(b["exchange_wait_s"], 1e-12), 4)}
print(json.dumps(doc, indent=1))
PYEOF
cat "$out/overlap_timing.json"
exit $rc
