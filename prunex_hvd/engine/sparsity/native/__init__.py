"""The one native kernel of the library: column-masked shrink and recover on CPU (``maskcopy.c``).

ATen gathers or scatters single columns one element at a time (0.2-0.5 of a copy's speed); ``maskcopy`` moves
8 columns per AVX2 shuffle and runs at or above copy speed. It is compiled on first use with the C compiler
that built Python's extensions (``cc``, a second or so) into ``$PRUNEX_CACHE`` (default
``~/.cache/prunex_hvd``)/native, keyed by the source's hash and the Python ABI, and written atomically so that
ranks starting together share one build. Where it cannot be built (no compiler or headers) the library warns
once and keeps ATen's paths: every result is the same, only slower. ``PRUNEX_HVD_NATIVE=0`` turns it off.

    from prunex_hvd.engine.sparsity import native
    native.available()     # True once built and loaded
    native.describe()      # 'avx2' / 'scalar', or why it is off
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import subprocess
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

_SOURCE = Path(__file__).with_name("maskcopy.c")
_state = {"module": None, "why": None, "tried": False}
_loading = threading.Lock()   # threads arriving together wait for the one build, not take ATen's path
# The kernel's two entry points, once module() has loaded it (see maskcopy.c for their arguments).
compress = expand = None


def cache_dir() -> Path:
    return Path(os.environ.get("PRUNEX_CACHE", Path.home() / ".cache" / "prunex_hvd")) / "native"


def _library_path() -> Path:
    src = _SOURCE.read_bytes()
    tag = hashlib.sha256(src + sysconfig.get_paths()["include"].encode()).hexdigest()[:16]
    return cache_dir() / f"_maskcopy-{tag}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def _compile(target: Path) -> None:
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    base = [*cc, "-O3", "-fPIC", "-shared", f"-I{sysconfig.get_paths()['include']}", str(_SOURCE)]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        # OpenMP splits rows over torch's threads; a compiler without it still gives a working one-thread build.
        for flags in (["-fopenmp"], []):
            res = subprocess.run(base + flags + ["-o", tmp], capture_output=True, text=True)
            if res.returncode == 0:
                os.replace(tmp, target)   # atomic: ranks building at once each rename a whole file
                return
        raise RuntimeError(f"{' '.join(base)} failed:\n{res.stderr.strip()[-2000:]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: Path):
    loader = importlib.machinery.ExtensionFileLoader("_maskcopy", str(path))
    spec = importlib.util.spec_from_file_location("_maskcopy", str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def module():
    """The loaded ``_maskcopy`` extension, building it on first use; None where it is off or cannot be built."""
    if _state["tried"]:
        return _state["module"]
    with _loading:
        if not _state["tried"]:
            _load_once()
            _state["tried"] = True
    return _state["module"]


def _load_once() -> None:
    if os.environ.get("PRUNEX_HVD_NATIVE", "1").strip().lower() in ("0", "off", "false", "no"):
        _state["why"] = "off (PRUNEX_HVD_NATIVE=0)"
        return
    import torch  # noqa: F401  (loaded first, so the extension's libgomp resolves to torch's own)
    try:
        path = _library_path()
        if not path.exists():
            _compile(path)
        _state["module"] = _load(path)
        global compress, expand
        compress, expand = _state["module"].compress, _state["module"].expand
    except Exception as exc:   # any failure: ATen's paths still give the same results
        _state["why"] = f"unavailable: {exc}"
        warnings.warn(f"prunex_hvd: the native shrink/recover kernel is {_state['why']}; using ATen's "
                      "(slower on CPU for single-column structures). Set PRUNEX_HVD_NATIVE=0 to silence.",
                      RuntimeWarning, stacklevel=4)


def available() -> bool:
    return module() is not None


def describe() -> str:
    m = module()
    return m.simd() if m is not None else str(_state["why"])


def build() -> Optional[Path]:
    """Build now (``python -m prunex_hvd.engine.sparsity.native``, run by ``make setup``) and return the
    library's path."""
    return _library_path() if module() is not None else None
