#!/usr/bin/env bash
# `make demo`: on 4 ranks as 2 emulated nodes × 2 on this machine, in one launch (`prunex-hvd compare`, the
# methods one after the other), train the small ResNet on the embedded digits data twice: a dense Horovod-style
# run (a gradient allreduce every step), the measured reference, and PruneX (channel keep 0.5, the CLI's recipe),
# with the same model, data, epochs, batch, lr and seed. compare then prints PruneX's inter-node bytes against the
# dense run's, both from the runs' byte ledgers, and both accuracies, and draws the report (runs/demo/report). mpirun with the node override by default; DEMO_LAUNCHER=horovodrun uses
# `horovodrun --gloo -H localhost:2,127.0.0.1:2` (two host names, two nodes).
set -euo pipefail
PY="${1:-python3}"
BIN="$(dirname "$PY")"
OUT="${DEMO_OUT:-runs/demo}"
LAUNCHER="${DEMO_LAUNCHER:-mpirun}"
EPOCHS="${DEMO_EPOCHS:-16}"   # the two runs fit in 2 minutes on 2 cores; PruneX ends above 99% on digits
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
rm -rf "$OUT"
RUNS=("$BIN/prunex-hvd" compare --methods dense,prunex --model resnet_small --dataset digits --sparsity channel:0.5
      --epochs "$EPOCHS" --local-epochs 1 --batch-size 16 --lr 0.05 --out "$OUT")
echo "== dense (measured reference) then PruneX on digits, $EPOCHS epochs each: 4 ranks = 2 emulated nodes x 2," \
     "launcher $LAUNCHER =="
if [ "$LAUNCHER" = horovodrun ]; then   # Horovod's Gloo ops cost ~15 s an epoch on 2 cores: ~10 minutes in all
    timeout 1800 "$BIN/horovodrun" --gloo -np 4 -H localhost:2,127.0.0.1:2 "${RUNS[@]}" --backend horovod
else
    PRUNEX_RANKS_PER_NODE=2 timeout 900 mpirun -np 4 -x PRUNEX_RANKS_PER_NODE "${RUNS[@]}"
fi
