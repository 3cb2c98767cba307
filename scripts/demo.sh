#!/usr/bin/env bash
# `make demo`: 4 ranks as 2 emulated nodes × 2 on this machine, first under mpirun (node override), then
# under horovodrun --gloo with two host names. Each shows the topology every rank sees and a hierarchical
# allreduce probe: only the leaders send across nodes.
set -euo pipefail
PY="${1:-python3}"
BIN="$(dirname "$PY")"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
echo "== mpirun -np 4, PRUNEX_RANKS_PER_NODE=2 =="
PRUNEX_RANKS_PER_NODE=2 timeout 300 mpirun -np 4 -x PRUNEX_RANKS_PER_NODE "$BIN/prunex-hvd" info --probe-mb 8
if "$PY" -c "import horovod.torch" 2>/dev/null; then
    echo; echo "== horovodrun --gloo -np 4 -H localhost:2,127.0.0.1:2 =="
    timeout 300 "$BIN/horovodrun" --gloo -np 4 -H localhost:2,127.0.0.1:2 "$BIN/prunex-hvd" info --backend horovod --probe-mb 8 \
        2>&1 | sed -n 's/^\[0\]<stdout>://p'
fi
