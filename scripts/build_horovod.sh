#!/usr/bin/env bash
# Build Horovod 0.28.1 from the PyPI sdist with C++17 (torch >= 2.1 headers need it) and install it.
# The wheel is cached per (python, torch, cuda) so a second run only installs it.
#   usage: build_horovod.sh PYTHON CACHE_DIR
set -euo pipefail
PYBIN="$1"; CACHE="$2"
HVD_VERSION=0.28.1
say() { printf '[horovod] %s\n' "$*"; }
key="$("$PYBIN" -c 'import sys,torch; print("py%d%d-torch%s-%s" % (sys.version_info[0], sys.version_info[1], torch.__version__.split("+")[0], "cu"+torch.version.cuda.replace(".","") if torch.version.cuda else "cpu"))')"
dest="$CACHE/horovod-$HVD_VERSION-$key"
mkdir -p "$dest"
wheel="$(ls "$dest"/horovod-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$wheel" ]; then
    work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
    say "building Horovod $HVD_VERSION for $key (takes a few minutes)"
    "$PYBIN" -m pip install -q setuptools wheel cmake packaging psutil pyyaml cloudpickle cffi
    "$PYBIN" -m pip download -q --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$work"
    tar -xzf "$work"/horovod-$HVD_VERSION.tar.gz -C "$work"
    src="$work/horovod-$HVD_VERSION"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/CMakeLists.txt" || { say "C++17 patch did not apply"; exit 1; }
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
    export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
    if "$PYBIN" -c 'import torch,sys; sys.exit(0 if torch.version.cuda else 1)'; then
        export HOROVOD_GPU_OPERATIONS="${HOROVOD_GPU_OPERATIONS:-NCCL}"
    fi
    export MAKEFLAGS="-j$(nproc)"
    "$PYBIN" -m pip wheel -q --no-build-isolation --no-deps "$src" -w "$work/out"
    cp "$work"/out/horovod-*.whl "$dest/"
    wheel="$(ls "$dest"/horovod-*.whl | head -n1)"
fi
say "installing $(basename "$wheel")"
"$PYBIN" -m pip install -q --no-deps "$wheel"
"$PYBIN" -m pip install -q cloudpickle psutil pyyaml packaging cffi
