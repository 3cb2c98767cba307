"""The native column kernel (prunex_hvd/engine/sparsity/native/maskcopy.c) against ATen's paths: the same blocks
and tensors for every shape, row subset, dtype and thread count, never a write outside its output, and a clean
fallback."""
import copy
import os
import shutil
import subprocess
import sys

import pytest
import torch

from prunex_hvd.engine.sparsity import native
from prunex_hvd.engine.sparsity import (KernelPlan, apply_masks, gather_plan, gemm_view, masks_to_indices, recover,
                                 shrink, shrink_into, structured_masks)

needs_kernel = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.describe()}")


def test_the_kernel_builds_wherever_there_is_a_compiler():
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    assert native.available(), native.describe()
    assert native.describe() in ("avx2", "scalar")


def random_masks(n_rows, n_cols, row_keep, col_keep, gen):
    rows = torch.rand(n_rows, generator=gen) < row_keep
    cols = torch.rand(n_cols, generator=gen) < col_keep
    return rows, cols


SHAPES = [(1, 1, 1, 1), (3, 5, 1, 1), (7, 1, 1, 9), (16, 8, 3, 3), (33, 17, 1, 1), (12, 6, 3, 3), (5, 3, 7, 7),
          (64, 64, 3, 3), (300, 130, 1, 1)]


@pytest.fixture(params=["simd", "scalar"])
def loops(request):
    """Each case on both the AVX2 loops and the scalar ones (what a CPU without AVX2 runs)."""
    before = native.module().use_simd(request.param == "simd")
    yield request.param
    native.module().use_simd(before)


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("row_keep,col_keep", [(1.0, 0.5), (0.5, 0.5), (1.0, 0.1), (0.6, 0.95), (0.3, 0.0),
                                                (1.0, 0.99), (0.5, 1.0), (0.0, 0.5)])
def test_kernel_matches_aten_on_random_column_sets(shape, row_keep, col_keep, loops):
    gen = torch.Generator().manual_seed(hash((shape, row_keep, col_keep)) % 2**31)
    w = torch.randn(shape, generator=gen)
    n_rows, n_cols = gemm_view(w).shape
    for _ in range(3):
        rows, cols = random_masks(n_rows, n_cols, row_keep, col_keep, gen)
        if bool(cols.all()) and bool(rows.all()):   # dense: no plan, a plain copy
            assert gather_plan(*masks_to_indices(rows, cols), w.shape) is None
            continue
        r, c = masks_to_indices(rows, cols)
        plan = gather_plan(r, c, w.shape)
        assert isinstance(plan, KernelPlan)
        want = gemm_view(w)[r][:, c]
        # the block inside a larger buffer of sentinels: nothing outside it may be written
        buf = torch.full((len(r) * len(c) + 64,), float("nan"))
        view = buf[13: 13 + len(r) * len(c)]
        assert torch.equal(shrink(w, r, c, out=view, plan=plan), want)
        assert buf[:13].isnan().all() and buf[13 + view.numel():].isnan().all()
        assert torch.equal(shrink(w, r, c, plan=plan), want)
        view.fill_(float("nan"))
        shrink_into(w, r, c, view, plan=plan)
        assert torch.equal(view, want.reshape(-1))
        assert buf[:13].isnan().all() and buf[13 + view.numel():].isnan().all()
        full = torch.full_like(w, float("nan"))
        assert torch.equal(recover(view, r, c, w.shape, out=full, plan=plan), apply_masks(w, rows, cols))
        assert torch.equal(recover(view, r, c, w.shape, plan=plan), apply_masks(w, rows, cols))
        twin = copy.deepcopy(plan)   # a plan owns its tensors: a copy stands alone
        del plan
        assert torch.equal(shrink(w, r, c, plan=twin), want)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16])
def test_kernel_dtypes_and_the_ones_it_leaves_to_aten(dtype, loops):
    """4- and 8-byte elements take the kernel; others (and mixed dtypes) fall back to ATen, same results."""
    w = (torch.randn(24, 10, 3, 3) * 100).to(dtype)
    for spec in ["shape:0.5", "channel:0.5", "filter:0.5+channel:0.3", "filter:0.7+channel:0.5+shape:0.5"]:
        rows, cols = structured_masks(w.float(), spec)
        r, c = masks_to_indices(rows, cols)
        plan = gather_plan(r, c, w.shape)
        want = gemm_view(w)[r][:, c]
        assert torch.equal(shrink(w, r, c, plan=plan), want)
        assert torch.equal(shrink(w, r, c, out=torch.empty(want.numel(), dtype=dtype), plan=plan), want)
        assert torch.equal(shrink(w, r, c, out=torch.empty(want.numel(), dtype=torch.float32), plan=plan),
                           want.float())
        into = torch.empty(want.numel(), dtype=torch.float32)   # another dtype: ATen casts
        shrink_into(w, r, c, into, plan=plan)
        assert torch.equal(into, want.float().reshape(-1))
        full = torch.ones_like(w)
        assert torch.equal(recover(want, r, c, w.shape, out=full, plan=plan), apply_masks(w, rows, cols))
        assert torch.equal(recover(want, r, c, w.shape, plan=plan), apply_masks(w, rows, cols))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_splits_rows_over_threads(threads, loops):
    """Large layers run on torch's threads: every split gives the same result, every element written once."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        w = torch.randn(512, 256, 3, 3)
        for spec in ["shape:0.5", "filter:0.5+channel:0.5", "channel:0.3"]:
            rows, cols = structured_masks(w, spec)
            r, c = masks_to_indices(rows, cols)
            plan = gather_plan(r, c, w.shape)
            block = shrink(w, r, c, plan=plan)
            assert torch.equal(block, gemm_view(w)[r][:, c])
            full = torch.full_like(w, float("nan"))
            assert torch.equal(recover(block, r, c, w.shape, out=full, plan=plan), apply_masks(w, rows, cols))
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_kernel_leaves_autograd_and_odd_layouts_to_aten():
    w = torch.randn(16, 8, 3, 3, requires_grad=True)
    rows, cols = structured_masks(w.detach(), "shape:0.5")
    r, c = masks_to_indices(rows, cols)
    plan = gather_plan(r, c, w.shape)
    block = shrink(w, r, c, plan=plan)            # differentiable: ATen's gather
    block.sum().backward()
    assert torch.equal(w.grad, apply_masks(torch.ones_like(w), rows, cols))
    back = recover(block, r, c, w.shape, plan=plan)
    assert back.requires_grad and torch.equal(back.detach(), apply_masks(w.detach(), rows, cols))
    t = w.detach().transpose(2, 3)                 # not contiguous
    assert torch.equal(shrink(t, r, c, plan=plan), gemm_view(t.contiguous())[r][:, c])
    out = torch.empty(16, 8, 3, 3).transpose(0, 1).transpose(0, 1)[:, :, :, :]
    assert torch.equal(recover(block.detach(), r, c, w.shape, out=out, plan=plan), apply_masks(w.detach(), rows, cols))


def run_python(code, **env):
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


CHECK = """
import warnings, torch
from prunex_hvd import sparsity
from prunex_hvd.engine.sparsity import native
w = torch.randn(32, 16, 3, 3)
rows, cols = sparsity.structured_masks(w, "shape:0.5")
r, c = sparsity.masks_to_indices(rows, cols)
plan = sparsity.gather_plan(r, c, w.shape)
assert torch.equal(sparsity.recover(sparsity.shrink(w, r, c, plan=plan), r, c, w.shape, plan=plan),
                   sparsity.apply_masks(w, rows, cols))
print(type(plan).__name__, native.describe())
"""


def test_kernel_can_be_turned_off(tmp_path):
    res = run_python(CHECK, PRUNEX_HVD_NATIVE="0", PRUNEX_CACHE=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "NoneType off (PRUNEX_HVD_NATIVE=0)"
    assert not any(tmp_path.iterdir())            # nothing built


def test_a_failed_build_warns_once_and_falls_back(tmp_path):
    res = run_python(CHECK, CC="false", PRUNEX_CACHE=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("NoneType unavailable:"), res.stdout
    assert res.stderr.count("native shrink/recover kernel is unavailable") == 1, res.stderr
    assert not list((tmp_path / "native").glob("*.tmp"))   # no half-written files left


@needs_kernel
def test_ranks_building_at_once_share_one_build(tmp_path):
    """Four processes on an empty cache: each builds and renames atomically; all load a whole library."""
    procs = [subprocess.Popen([sys.executable, "-c", CHECK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PRUNEX_CACHE": str(tmp_path)}) for _ in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.split()[0] == "KernelPlan", out
    built = list((tmp_path / "native").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so", built
