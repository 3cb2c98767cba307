"""Without a launcher the package still works as one rank (run in a subprocess: MPI may start in it)."""
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parents[1] / "workers" / "single_worker.py"


def run_single(backend):
    env_clean = {k: v for k, v in __import__("os").environ.items()
                 if not k.startswith(("OMPI_", "PMIX_", "PMI_", "HOROVOD_"))}
    return subprocess.run([sys.executable, str(WORKER), backend], capture_output=True, text=True, timeout=120,
                          env=env_clean)


@pytest.mark.parametrize("backend", ["auto", "gloo", "mpi"])
def test_single_process(backend):
    proc = run_single(backend)
    assert proc.returncode == 0 and proc.stdout.startswith("ok rank 0/1"), proc.stdout + proc.stderr


def test_horovod_backend_needs_a_launch():
    proc = run_single("horovod")
    assert proc.returncode == 3
    assert ("needs a launch by horovodrun" in proc.stdout) or ("Horovod is not importable" in proc.stdout)


def test_unknown_backend_is_a_value_error():
    import prunex_hvd as px
    with pytest.raises(ValueError, match="unknown backend 'tcp'"):
        px.init(backend="tcp")
    assert not px.is_initialized()
