"""The console script under a real launch, and the Makefile's interpreter lookup."""
import json
import os
import re
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


@needs_mpirun
@pytest.mark.launch
def test_info_shows_racks_from_the_environment():
    """8 ranks as 2 racks × 2 nodes × 2 (PRUNEX_RANKS_PER_NODE, PRUNEX_NODES_PER_RACK): every rank's topology,
    and a value the ranks disagree on (one rank told 4) is one error on every rank."""
    proc = run(mpirun(8, [str(BIN / "prunex-hvd"), "info", "--json"],
                      ["PRUNEX_RANKS_PER_NODE=2", "PRUNEX_NODES_PER_RACK=2"]), timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:]
    ranks = [row["topology"] for row in json.loads(proc.stdout[proc.stdout.index("{"):])["ranks"]]
    assert [(t["rack"], t["node"], t["is_rack_leader"]) for t in ranks] == \
        [(r // 4, r // 2, r % 4 == 0) for r in range(8)]
    assert {str(t["rack_nodes"]) for t in ranks} == {"[[0, 1], [2, 3]]"}
    script = ("import os, prunex_hvd as px; r = int(os.environ['OMPI_COMM_WORLD_RANK'])\n"
              "try:\n    px.init(ranks_per_node=2, nodes_per_rack=4 if r == 5 else 2)\n"
              "except px.TopologyError as e:\n    print(f'[rank {r}] refused: {e}', flush=True)")
    proc = run(mpirun(8, [sys.executable, "-c", script]), timeout=180)
    # mpirun may join two ranks' lines into one: find every rank's message in the whole output
    said = re.findall(r"\[rank (\d)\] refused: ranks disagree about nodes_per_rack \(PRUNEX_NODES_PER_RACK\): "
                      r"2 on ranks 0,1,2,3,4,6,7; 4 on ranks 5\.", proc.stdout)
    assert sorted(map(int, said)) == list(range(8)), proc.stdout[-3000:]
