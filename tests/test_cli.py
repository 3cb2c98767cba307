"""The console script under a real launch, and the Makefile's interpreter lookup."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launching import BIN, mpirun, needs_mpirun, run

REPO = Path(__file__).resolve().parents[1]


@needs_mpirun
@pytest.mark.launch
def test_info_probe_counts_leader_bytes_only():
    proc = run(mpirun(4, [str(BIN / "prunex-hvd"), "info", "--ranks-per-node", "2", "--probe-mb", "1",
                          "--json"]), timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert report["backends"]["mpi"] == "ok" and len(report["ranks"]) == 4
    mib = 2**20
    for row in report["ranks"]:
        t, probe = row["topology"], row["probe"]
        # leaders: one inter-node allreduce of 1 MiB between 2 nodes sends exactly 1 MiB across
        assert probe["total"]["cross_node_bytes"] == (mib if t["is_leader"] else 0)
        assert probe["inter"]["payload_bytes"] == (mib if t["is_leader"] else 0)
        assert probe["intra"]["payload_bytes"] == 2 * mib  # the node sum and the broadcast back


def test_cli_usage_error_is_friendly():
    proc = subprocess.run([str(BIN / "prunex-hvd"), "info", "--backend", "carrier-pigeon"], capture_output=True,
                          text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI"))})
    assert proc.returncode == 2
    assert "prunex-hvd: error: unknown backend 'carrier-pigeon'" in proc.stderr


@pytest.mark.skipif(not (REPO / "Makefile").exists(), reason="needs the source tree")
def test_make_python_prints_the_env_interpreter():
    out = subprocess.run(["make", "-s", "python"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout.strip()
    assert os.path.isabs(out) and Path(out).exists()
    assert subprocess.run([out, "-c", "import prunex_hvd"], timeout=120).returncode == 0
    if Path(sys.executable).parent.parent == REPO / ".venv":
        assert Path(out) == Path(sys.executable)
