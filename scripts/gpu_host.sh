# Sourced by the GPU-host scripts (gpu_checks.sh, gpu_overlap.sh): OUTDIR from $1 (made), the checkout as the
# working directory and on PYTHONPATH (no install: the host's own python3 with CUDA torch, or $PYTHON), and the
# GPU, driver, torch, CUDA and NCCL versions printed first.
set -uo pipefail
out="${1:?usage: $(basename "$0") OUTDIR}"
mkdir -p "$out"
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
