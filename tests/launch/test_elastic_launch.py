"""A node lost mid-run, and brought back, for real, under horovodrun's elastic mode (2 hosts × 2 ranks on this
machine: ``localhost`` and ``127.0.0.1``, listed by a host-discovery script that reads a file).

The Python API (tests/workers/elastic_worker.py, committing every round): the test kills both ranks of host
127.0.0.1 (SIGKILL) at round K and takes it off the list; the survivors must go on from memory: the same
processes, the next round the next number, over one node. At round K + M the host is listed again and its new
ranks join. The job ends on the same consensus model on all four ranks.

The command line (``prunex-hvd train --elastic``): the same loss; the job ends over the node left, and its last
checkpoint, written over that node, resumes bit for bit under a plain launch."""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launching import BIN, ROOT_ENV, horovodrun, needs_horovod, python_cmd, run
from training_job import assert_same_run, metrics

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
            pytest.fail(f"the job ended (exit {proc.returncode}) while waiting for {what}:\n"
                        f"{proc.stdout.read()[-6000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"timed out waiting for {what}:\n{proc.stdout.read()[-6000:]}")
        time.sleep(0.2)


def elastic_launch(tmp_path, cmd):
    """``cmd`` under horovodrun's elastic mode on hosts localhost:2 and 127.0.0.1:2 (the file tmp_path/hosts.txt,
    which the test rewrites); every process first leaves tmp_path/pids/HOST.PID. Returns (the process, the hosts
    file)."""
    hosts, pids = tmp_path / "hosts.txt", tmp_path / "pids"
    pids.mkdir()
    hosts.write_text("localhost:2\n127.0.0.1:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    mark = f'touch {pids}/$HOROVOD_HOSTNAME.$$ && exec "$@"'
    full = [str(BIN / "horovodrun"), "-np", "4", "--min-np", "2", "--max-np", "4", "--blacklist-cooldown-range", "1",
            "2", "--host-discovery-script", str(discover), "sh", "-c", mark, "sh"] + cmd
    env = dict(os.environ, **dict(ROOT_ENV, HOROVOD_GLOO_TIMEOUT_SECONDS=str(GLOO_TIMEOUT_S)))
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    return subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True), hosts


def started_pids(tmp_path) -> dict:
    """{host: sorted pids} of the processes started so far."""
    found: dict = {}
    for p in (tmp_path / "pids").iterdir():
        host, pid = p.name.rsplit(".", 1)
        found.setdefault(host, []).append(int(pid))
    return {host: sorted(p) for host, p in found.items()}


@contextlib.contextmanager
def ended_on_failure(proc):
    """The whole launch killed if the block fails."""
    try:
        yield
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        raise


def finished(proc, deadline) -> str:
    """The launch's output once it has ended, successfully, by ``deadline``."""
    stdout, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    assert proc.returncode == 0, stdout[-6000:]
    return stdout


def kill_host(hosts, pids, host="127.0.0.1"):
    """Take ``host`` off the list and kill its ranks; returns when."""
    hosts.write_text("localhost:2\n")
    for pid in pids[host]:
        os.kill(pid, signal.SIGKILL)
    return time.time()


def test_a_node_lost_mid_run_costs_a_round_and_comes_back(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc, hosts = elastic_launch(tmp_path, python_cmd("elastic_worker.py", str(out), str(ROUNDS), "0.05"))
    deadline = time.monotonic() + 300
    with ended_on_failure(proc):
        wait_for(f"round {KILL_AT}", lambda: len(progress(out)) >= KILL_AT, proc, deadline)
        pids = started_pids(tmp_path)
        killed_at = kill_host(hosts, pids)
        wait_for("the survivors' next rounds", lambda: len([p for p in progress(out) if p["ranks"] == 2]) >= 2,
                 proc, deadline)
        wait_for(f"round {BACK_AT}", lambda: progress(out)[-1]["round"] >= BACK_AT, proc, deadline)
        hosts.write_text("localhost:2\n127.0.0.1:2\n")
        back_at = time.time()
        finished(proc, deadline)

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


def test_the_command_line_goes_on_without_a_node_and_its_checkpoint_resumes_bit_for_bit(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--model", "resnet_small", "--dataset", "digits", "--image-size", "8", "--epochs", "3", "--local-steps",
            "3", "--batch-size", "16", "--threads", "1", "--checkpoint-every", "10"]
    proc, hosts = elastic_launch(tmp_path, [str(BIN / "prunex-hvd"), "train", "--elastic", *args, "--out",
                                            str(run_dir)])
    rounds = lambda: [r for r in metrics(run_dir) if r["event"] == "round"] \
        if (run_dir / "metrics.jsonl").exists() else []   # noqa: E731
    deadline = time.monotonic() + 300
    with ended_on_failure(proc):
        wait_for("round 4", lambda: len(rounds()) >= 4, proc, deadline)
        pids = started_pids(tmp_path)
        kill_host(hosts, pids)
        finished(proc, deadline)
    lines = metrics(run_dir)
    changes = [r for r in lines if r["event"] == "nodes"]
    assert [(c["ranks"], c["nodes"], c["joined"]) for c in changes] == [(2, 1, [])], changes
    after = [r for r in lines if r["event"] == "round" and r["step"] > changes[0]["step"]]
    assert {r["ranks"] for r in after} == {2} and after[0]["round"] == changes[0]["round"] + 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final_test_acc"] > 0.5, summary
    assert sorted(started_pids(tmp_path)["localhost"]) == pids["localhost"]   # no process restarted

    # the last checkpoint was written over the node left: resumed there, the run ends bit for bit the same
    manifest = json.loads((run_dir / "checkpoint.json").read_text())
    assert manifest["meta"]["world_size"] == 2, manifest["meta"]
    again = tmp_path / "again"
    shutil.copytree(run_dir, again)
    for name in ("summary.json", "final_model.pt"):
        (again / name).unlink()
    resumed = run(horovodrun(2, "localhost:2", [str(BIN / "prunex-hvd"), "train", "--elastic", *args, "--resume",
                                                "--out", str(again)]), timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    assert "a lost rank ends the job" in resumed.stdout
    drop = {"nodes"}
    assert_same_run(run_dir, again, skip_events=drop)
