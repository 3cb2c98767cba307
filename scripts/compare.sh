#!/usr/bin/env bash
# `make compare`: every method on the same model, data, sampler and byte counters (4 ranks as 2 emulated
# nodes × 2 under mpirun), then a table (accuracy, density, inter-node bytes, wall time) and the plots.
set -euo pipefail
PY="${1:-python3}"
BIN="$(dirname "$PY")"
OUT="${COMPARE_OUT:-runs/compare}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
rm -rf "$OUT"
PRUNEX_RANKS_PER_NODE=2 timeout 1800 mpirun -np 4 -x PRUNEX_RANKS_PER_NODE "$BIN/prunex-hvd" compare \
    --methods "${COMPARE_METHODS:-dense,topk,pactrain,localsgd,localsgd-hier,diloco,prunex-flat,prunex}" \
    --model resnet_small --dataset digits --sparsity channel:0.5 --epochs 24 --local-epochs 1 --batch-size 16 \
    --lr 0.05 --topk-ratio 0.01 --out "$OUT"
