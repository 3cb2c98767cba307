"""A node lost mid-run and brought back, for real, under horovodrun's elastic mode (2 hosts × 2 ranks on this
machine: ``localhost`` and ``127.0.0.1``, listed by a host-discovery script that reads a file).

tests/workers/elastic_worker.py trains through prunex_hvd.elastic, committing every round. The test kills both
ranks of host 127.0.0.1 (SIGKILL) at round K and takes it off the list; the survivors must go on from memory: the
same processes, the next round the next number, over one node. At round K + M the host is listed again and its new
ranks join. The job ends every round on the same consensus model on all four ranks."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launching import BIN, ROOT_ENV, needs_horovod, python_cmd

pytestmark = [pytest.mark.launch, needs_horovod]

ROUNDS, KILL_AT, BACK_AT = 30, 5, 12
# how long a Gloo collective (Horovod's own too) waits for a silent peer: a loss costs about this much, and a
# joining host must reach Horovod's rendezvous within it
GLOO_TIMEOUT_S = 20


def progress(out: Path) -> list:
    path = out / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(what, predicate, proc, deadline):
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the job ended (exit {proc.returncode}) while waiting for {what}:\n{proc.stdout.read()[-6000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"timed out waiting for {what}:\n{proc.stdout.read()[-6000:]}")
        time.sleep(0.2)


def test_a_node_lost_mid_run_costs_a_round_and_comes_back(tmp_path):
    out, hosts = tmp_path / "out", tmp_path / "hosts.txt"
    out.mkdir()
    hosts.write_text("localhost:2\n127.0.0.1:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    cmd = [str(BIN / "horovodrun"), "-np", "4", "--min-np", "2", "--max-np", "4", "--blacklist-cooldown-range", "1",
           "2", "--host-discovery-script", str(discover)] + python_cmd("elastic_worker.py", str(out), str(ROUNDS),
                                                                       "0.05")
    env = dict(os.environ, **dict(ROOT_ENV, HOROVOD_GLOO_TIMEOUT_SECONDS=str(GLOO_TIMEOUT_S)))
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    try:
        wait_for(f"round {KILL_AT}", lambda: len(progress(out)) >= KILL_AT, proc, deadline)
        started = {p.name.rsplit(".", 1)[0]: p.name.rsplit(".", 1)[1] for p in (out / "pids").iterdir()}
        pids = {host: sorted(int(p.name.rsplit(".", 1)[1]) for p in (out / "pids").iterdir()
                             if p.name.rsplit(".", 1)[0] == host) for host in started}
        hosts.write_text("localhost:2\n")
        for pid in pids["127.0.0.1"]:
            os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        wait_for("the survivors' next rounds", lambda: len([p for p in progress(out) if p["ranks"] == 2]) >= 2,
                 proc, deadline)
        wait_for(f"round {BACK_AT}", lambda: progress(out)[-1]["round"] >= BACK_AT, proc, deadline)
        hosts.write_text("localhost:2\n127.0.0.1:2\n")
        back_at = time.time()
        stdout, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, stdout[-6000:]

    finals = [json.loads((out / "final" / f"rank{r}.json").read_text()) for r in range(4)]
    assert {f["rounds"] for f in finals} == {ROUNDS}
    assert len({f["checksum"] for f in finals}) == 1, finals   # one consensus model everywhere
    survivors = [f for f in finals if f["host"] == "localhost"]
    joiners = [f for f in finals if f["host"] == "127.0.0.1"]
    # the survivors are the processes that started the job: they went on from memory, not from a restart
    assert sorted(f["pid"] for f in survivors) == pids["localhost"], (finals, pids)
    assert not set(f["pid"] for f in joiners) & set(pids["127.0.0.1"])
    for f in survivors:
        sizes = [(c["ranks"], c["nodes"]) for c in f["changes"]]
        assert sizes == [(4, 2), (2, 1), (4, 2)], f["changes"]
        assert f["changes"][0]["fresh"] and not f["changes"][1]["fresh"] and f["changes"][2]["joined"]
    for f in joiners:   # they joined at the round the job had reached, with its batch counter
        assert [(c["ranks"], c["round"] > BACK_AT - 1) for c in f["changes"]] == [(4, True)], f["changes"]

    lines = progress(out)
    rounds = [p["round"] for p in lines]
    assert set(rounds) == set(range(1, ROUNDS + 1)), rounds   # no round skipped
    # a round the lost node finished before the survivors did is run again by them, nothing further back
    assert all(b >= a for a, b in zip(rounds, rounds[1:])) and len(rounds) - ROUNDS <= 1, rounds
    after_loss = next(p for p in lines if p["ranks"] == 2)
    after_join = next(p for p in lines if p["ranks"] == 4 and p["round"] > after_loss["round"])
    lost_s, join_s = after_loss["time"] - killed_at, after_join["time"] - back_at
    assert lost_s < GLOO_TIMEOUT_S + 30, lost_s
    print(f"elastic: node lost at round {after_loss['round'] - 1}: {lost_s:.1f} s from the kill to the next "
          f"round; joined at round {after_join['round'] - 1}: {join_s:.1f} s from being listed to the next round")
