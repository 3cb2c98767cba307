"""Real multi-process launches for the tests: mpirun, horovodrun (gloo / mpi) and torchrun, each under a
timeout that kills the whole process group, so a hang fails the test instead of the CI job."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
WORKERS = Path(__file__).parent / "workers"
ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_rmaps_base_oversubscribe": "1", "PYTHONUNBUFFERED": "1",
            # a rank that aborts (SIGABRT, SIGSEGV) prints every thread's Python stack: which one, and where
            "PYTHONFAULTHANDLER": "1",
            # Open MPI on one small host: no InfiniBand probing, shared memory + loopback TCP
            "OMPI_MCA_btl": "self,vader,tcp", "OMPI_MCA_btl_tcp_if_include": "lo",
            "OMPI_MCA_oob_tcp_if_include": "lo",
            # rank 0 of the engine tests checks every round against the reference while the others wait:
            # on a loaded 2-core host that can outlast Gloo's default 30 s
            "HOROVOD_GLOO_TIMEOUT_SECONDS": "300"}


def have_horovod() -> bool:
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        return False
    return True


needs_horovod = pytest.mark.skipif(not have_horovod(), reason="Horovod is not installed (make setup builds it)")
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found (make setup installs it)")


def python_cmd(script: str, *args: str) -> list:
    return [sys.executable, str(WORKERS / script), *args]


def mpirun(np_: int, cmd: list, env_vars=()) -> list:
    out = ["mpirun", "--oversubscribe", "-np", str(np_)]
    for v in env_vars:
        out += ["-x", v]
    return out + cmd


def horovodrun(np_: int, hosts: str, cmd: list, controller: str = "gloo") -> list:
    return [str(BIN / "horovodrun"), f"--{controller}", "-np", str(np_), "-H", hosts] + cmd


def torchrun(nproc: int, cmd: list) -> list:
    return [str(BIN / "torchrun"), "--standalone", "--no-python", f"--nproc_per_node={nproc}"] + cmd


def worker_results(proc: subprocess.CompletedProcess, out: Path, name: str, ranks: int = 4,
                   case: str | None = None) -> list:
    """Assert every rank of a ``tests/workers`` job reported ok (else show its "NAME worker error" lines and
    the output's tail) and return each rank's ``rank{R}.json``; ``case``: one case of a launch that ran several
    (its files in OUT/CASE)."""
    import json
    import re
    errors = [line for line in proc.stdout.splitlines() if f"{name} worker error" in line]
    assert proc.returncode == 0, "\n".join(errors) + "\n" + proc.stdout[-6000:]
    assert re.findall(r"\] ok checks=\d+(?: case=([\w.-]+))?", proc.stdout).count(case or "") == ranks, \
        proc.stdout[-6000:]
    folder = Path(out) / case if case else Path(out)
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(ranks)]


def run(cmd: list, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **ROOT_ENV, **(env or {}))
    full_env["PATH"] = f"{BIN}:{full_env.get('PATH', '')}"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"launch hung for {timeout}s and was killed: {' '.join(cmd)}\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)
