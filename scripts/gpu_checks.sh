#!/usr/bin/env bash
# What a GPU host checks that CI (CPU only) cannot: the CUDA / NCCL tests and the CUDA shrink/recover figures.
# Runs with the host's own python3 (torch with CUDA) and the package from this checkout, no install:
#   bash scripts/gpu_checks.sh OUTDIR
# Writes OUTDIR/gpu_tests.log, OUTDIR/shrink_cuda.json and OUTDIR/shrink_cpu_2threads.json (the CPU figures
# pinned to 2 cores, the size of the CI machine, on a quiet host).
source "$(dirname "$0")/gpu_host.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
command -v mpirun >/dev/null && mpirun --version | head -1 || echo "no mpirun here: the launch tests skip"

rc=0
"$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$out/gpu_tests.log" || rc=1
"$PY" -m pytest -q -p no:cacheprovider tests/math/test_sparsity.py 2>&1 | tail -3 | tee -a "$out/gpu_tests.log" || rc=1
"$PY" benchmarks/bench_shrink.py --device cuda --reps 30 > "$out/shrink_cuda.json" || rc=1
taskset -c 0,1 "$PY" -c "import torch, runpy, sys; torch.set_num_threads(2); \
sys.argv = ['bench_shrink.py', '--device', 'cpu', '--reps', '30']; runpy.run_path('benchmarks/bench_shrink.py', run_name='__main__')" \
    > "$out/shrink_cpu_2threads.json" || rc=1
exit $rc
