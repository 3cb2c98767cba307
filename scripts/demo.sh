#!/usr/bin/env bash
# `make demo`: train the small ResNet on the embedded digits data with PruneX (channel keep 0.5, the CLI's
# recipe) on 4 ranks as 2 emulated nodes × 2 on this machine, then draw the plots. mpirun with the node override
# by default; DEMO_LAUNCHER=horovodrun uses `horovodrun --gloo -H localhost:2,127.0.0.1:2` (two host names, two nodes).
set -euo pipefail
PY="${1:-python3}"
BIN="$(dirname "$PY")"
OUT="${DEMO_OUT:-runs/demo}"
LAUNCHER="${DEMO_LAUNCHER:-mpirun}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
rm -rf "$OUT"
TRAIN=("$BIN/prunex-hvd" train --model resnet_small --dataset digits --method prunex --sparsity channel:0.5
       --epochs 24 --local-epochs 1 --batch-size 16 --lr 0.05
       --out "$OUT")
echo "== PruneX on digits: 4 ranks = 2 emulated nodes x 2, launcher $LAUNCHER =="
if [ "$LAUNCHER" = horovodrun ]; then
    timeout 900 "$BIN/horovodrun" --gloo -np 4 -H localhost:2,127.0.0.1:2 "${TRAIN[@]}" --backend horovod
else
    PRUNEX_RANKS_PER_NODE=2 timeout 900 mpirun -np 4 -x PRUNEX_RANKS_PER_NODE "${TRAIN[@]}"
fi
echo
"$BIN/prunex-hvd" report "$OUT" --out "$OUT/report"
