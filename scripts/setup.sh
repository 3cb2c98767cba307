#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian machine: Open MPI, a venv, torch, the package, patched Horovod.
# Every step checks before it acts, so a second run takes seconds.
#   VENV              where the virtual env lives          (default: <repo>/.venv)
#   PRUNEX_CACHE      where the built Horovod wheel and native kernel are kept (default: ~/.cache/prunex_hvd)
#   TORCH_SPEC        the torch requirement                (default: torch==2.13.0)
#   PRUNEX_NO_HOROVOD=1 skips Horovod (the package works without it: MPI / torch.distributed only)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-$here/.venv}"
PRUNEX_CACHE="${PRUNEX_CACHE:-$HOME/.cache/prunex_hvd}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PY="${PYTHON:-python3}"
say() { printf '[setup] %s\n' "$*"; }

# 1. Open MPI (headers for mpi4py and Horovod, mpirun for the launches).
if ! command -v mpicxx >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1; then
    say "installing Open MPI from Debian"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends openmpi-bin libopenmpi-dev >/dev/null
fi

# 2. The virtual env.
if [ ! -x "$VENV/bin/python" ]; then
    say "creating venv at $VENV"
    "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip "$@"; }
have() { "$VENV/bin/python" -c "import $1" >/dev/null 2>&1; }

# 3. torch first: Horovod compiles against it.
if ! "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.__version__.split('+')[0]=='${TORCH_SPEC#torch==}' else 1)" >/dev/null 2>&1; then
    say "installing $TORCH_SPEC"
    pip install -q "$TORCH_SPEC"
fi

# 4. The package itself (editable) with its test extras; torch_pruning too, so an older venv picks it up; again
#    when the installed `prunex-hvd` script no longer loads (its module moved since that venv was made).
entry_loads() {
    "$VENV/bin/python" -c "from importlib.metadata import entry_points as e; \
[p.load() for p in e(group='console_scripts') if p.name == 'prunex-hvd'] or exit(1)" >/dev/null 2>&1
}
if ! have prunex_hvd || ! have pytest || ! have xdist || ! have sklearn || ! have mpi4py || ! have torch_pruning || ! entry_loads; then
    say "installing prunex_hvd[dev]"
    pip install -q setuptools wheel
    pip install -q --no-build-isolation -e "$here[dev]"
fi

# 5. Horovod 0.28.1, patched to C++17, built once and cached outside the repo.
if [ "${PRUNEX_NO_HOROVOD:-0}" != "1" ] && ! have horovod.torch; then
    "$here/scripts/build_horovod.sh" "$VENV/bin/python" "$PRUNEX_CACHE"
fi
# 6. The native shrink/recover kernel (a second's compile, cached next to the wheel; built on first use too).
PRUNEX_CACHE="$PRUNEX_CACHE" "$VENV/bin/python" -m prunex_hvd.engine.sparsity.native
say "ready: $VENV/bin/python"
