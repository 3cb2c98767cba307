"""A node lost mid-run, and brought back, for real, under horovodrun's elastic mode.

On the emulated cluster (benchmarks/emulated_cluster.py: hosts pxh0 and pxh1 as network namespaces behind one
switch, 2 ranks each, horovodrun in its own namespace reaching them through an ssh stand-in), through the Python
API (tests/workers/elastic_worker.py, committing every round): the job starts on pxh0 alone and grows when pxh1 is
listed; then the test kills every process of host pxh1 at round K and takes it off the list; the survivors go on from memory (the same processes, the next round the next
number, over one node). The host is listed again and its new ranks join. Then pxh1's link stalls (its switch port
drops every frame; no end sees an error) and the host is taken off the list: once the collective timeout passes,
its ranks find themselves cut off and leave, and the survivors go on. The link comes back, the host is listed and
joins once more. The first round after every change is checked against the single-process reference of that
round (in the worker); the job ends on the same consensus model on all four ranks.

The command line (``prunex-hvd train --elastic``, hosts ``localhost`` and ``127.0.0.1`` on this machine): the
same loss; the job ends over the node left, and its last checkpoint, written over that node, resumes bit for bit
under a plain launch."""
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launching import BIN, ROOT_ENV, horovodrun, needs_horovod, python_cmd, run
from prunex_hvd.dist import node_commits
from prunex_hvd.dist.net import free_port
from training_job import assert_same_run, metrics

pytestmark = [pytest.mark.launch, needs_horovod]
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

KILL_AT = 5
CLUSTER_ROUNDS = 70
# how long a collective waits for a silent peer on the emulated cluster: a stalled link is a loss past it
STALL_TIMEOUT_S = 10
# how long a Gloo collective (Horovod's own too) waits for a silent peer: a loss costs about this much, and a
# joining host must reach Horovod's rendezvous within it
GLOO_TIMEOUT_S = 20


def progress(out: Path) -> list:
    path = out / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(what, predicate, proc, deadline, told=None):
    """Until ``predicate()``; failing, with what the launch printed (``told()``, else its stdout), if ``proc``
    ends first or ``deadline`` passes."""
    told = told or (lambda: proc.stdout.read()[-6000:])
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the job ended (exit {proc.returncode}) while waiting for {what}:\n{told()}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"timed out waiting for {what}:\n{told()}")
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


@pytest.fixture
def emulated_cluster(tmp_path):
    """Hosts pxh0 and pxh1 (2 network namespaces behind a switch; the launcher in its own), torn down after."""
    spec = importlib.util.spec_from_file_location("emulated_cluster", BENCH / "emulated_cluster.py")
    cluster = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cluster)
    why = cluster.preflight()
    if why:
        pytest.skip(f"the emulated cluster cannot be built here: {why}")
    cluster.teardown()
    try:
        cluster.build(2, 1500)
    except subprocess.CalledProcessError as exc:
        cluster.teardown()
        pytest.skip(f"network namespaces cannot be made here: {exc.stderr.strip()}")
    try:
        yield cluster
    finally:
        cluster.teardown()


def cluster_launch(tmp_path, cluster, cmd, collective_timeout_s):
    """``cmd`` under horovodrun's elastic mode, run in the launcher's namespace, on host pxh0:2 and later also
    pxh1:2 (the file tmp_path/hosts.txt, which the test rewrites; it starts with pxh0 alone). horovodrun reaches
    the hosts by ``ssh``: here a stand-in that runs the command inside the host's namespace
    (benchmarks/cluster/nsrsh). Returns (the process, the hosts file)."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("pxh0:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    prefix, nic, more_env = cluster.horovodrun_in_cluster(str(tmp_path), ["pxh0", "pxh1"])
    full = prefix + [str(BIN / "horovodrun"), "-np", "2", "--min-np", "2", "--max-np", "4",
                     "--blacklist-cooldown-range", "1", "2", "--host-discovery-script", str(discover)] + nic + cmd
    env = dict(os.environ, **dict(ROOT_ENV, HOROVOD_GLOO_TIMEOUT_SECONDS=str(GLOO_TIMEOUT_S),
                                  PRUNEX_TIMEOUT_S=str(collective_timeout_s)), **more_env)
    env["PATH"] = f"{BIN}:{env['PATH']}"
    return subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True), hosts


def worker_pids(out: Path) -> dict:
    """{host: sorted pids} of the workers started so far (each leaves OUT/pids/HOST.PID)."""
    found: dict = {}
    for p in (out / "pids").iterdir():
        host, pid = p.name.rsplit(".", 1)
        found.setdefault(host, []).append(int(pid))
    return {host: sorted(p) for host, p in found.items()}


def test_on_the_emulated_cluster_a_job_grows_and_a_killed_host_and_a_stalled_link_cost_a_round(
        tmp_path, emulated_cluster):
    cluster, out = emulated_cluster, tmp_path / "out"
    out.mkdir()
    proc, hosts = cluster_launch(tmp_path, cluster, python_cmd("elastic_worker.py", str(out), str(CLUSTER_ROUNDS),
                                                               "0.1"), collective_timeout_s=STALL_TIMEOUT_S)
    ranks_now = lambda n: progress(out) and progress(out)[-1]["ranks"] == n   # noqa: E731
    deadline = time.monotonic() + 420
    events = {}
    with ended_on_failure(proc):
        # 0. the job starts on pxh0 alone and grows: pxh1 listed, its ranks join
        wait_for("round 2", lambda: len(progress(out)) >= 2, proc, deadline)
        hosts.write_text("pxh0:2\npxh1:2\n")
        events["grown"] = time.time()
        wait_for("pxh1's ranks", lambda: ranks_now(4), proc, deadline)
        # 1. every process of pxh1 killed: the survivors go on over pxh0
        wait_for(f"round {KILL_AT}", lambda: len(progress(out)) >= KILL_AT, proc, deadline)
        first_pids = worker_pids(out)
        hosts.write_text("pxh0:2\n")
        events["killed"] = time.time()
        assert cluster.kill_namespace_processes(["pxh1"]) >= 2
        wait_for("the survivors' rounds after the kill", lambda: ranks_now(2), proc, deadline)
        # 2. pxh1 listed again: new ranks join
        hosts.write_text("pxh0:2\npxh1:2\n")
        events["listed"] = time.time()
        wait_for("pxh1's new ranks", lambda: ranks_now(4), proc, deadline)
        # 3. pxh1's link stalls, and it is taken off the list: past the timeout its ranks leave, the others go on
        joined_round = progress(out)[-1]["round"]
        wait_for("two rounds over both hosts", lambda: progress(out)[-1]["round"] >= joined_round + 2, proc, deadline)
        hosts.write_text("pxh0:2\n")
        events["stalled"] = time.time()
        cluster.set_link(1, up=False, hosts=2)
        wait_for("the survivors' rounds after the stall", lambda: ranks_now(2), proc, deadline)
        # 4. the link comes back, the host is listed and joins again
        cluster.set_link(1, up=True, hosts=2)
        hosts.write_text("pxh0:2\npxh1:2\n")
        events["back"] = time.time()
        stdout = finished(proc, deadline)

    finals = [json.loads((out / "final" / f"rank{r}.json").read_text()) for r in range(4)]
    assert {f["rounds"] for f in finals} == {CLUSTER_ROUNDS}
    assert len({f["checksum"] for f in finals}) == 1, finals   # one consensus model everywhere
    survivors = [f for f in finals if f["host"] == "pxh0"]
    # the survivors are the processes that started the job: they went on from memory, not from a restart
    assert sorted(f["pid"] for f in survivors) == first_pids["pxh0"], (finals, first_pids)
    for f in survivors:
        assert [(c["ranks"], c["nodes"]) for c in f["changes"]] == [(2, 1), (4, 2), (2, 1), (4, 2), (2, 1), (4, 2)], \
            f["changes"]
    assert not {f["pid"] for f in finals if f["host"] == "pxh1"} & set(first_pids["pxh1"])
    assert "host pxh1 cannot reach the launcher's rendezvous" in stdout, stdout[-6000:]

    lines = progress(out)
    rounds = [p["round"] for p in lines]
    assert set(rounds) == set(range(1, CLUSTER_ROUNDS + 1)), rounds   # no round skipped
    # a round the lost node finished before the survivors did is run again by them, nothing further back
    assert all(b >= a for a, b in zip(rounds, rounds[1:])), rounds
    # the first round over every new set of nodes (the start included) matched the reference round
    firsts = [p for i, p in enumerate(lines) if i == 0 or p["ranks"] != lines[i - 1]["ranks"]]
    assert [p["ranks"] for p in firsts] == [2, 4, 2, 4, 2, 4] and all(p["checked"] for p in firsts), firsts
    lost_s, stall_s = firsts[2]["time"] - events["killed"], firsts[4]["time"] - events["stalled"]
    assert lost_s < GLOO_TIMEOUT_S + 30, lost_s
    print(f"emulated cluster: grown: {firsts[1]['time'] - events['grown']:.1f} s to the first round over 2 hosts; "
          f"killed host: {lost_s:.1f} s to the next round; listed again: "
          f"{firsts[3]['time'] - events['listed']:.1f} s; stalled link: {stall_s:.1f} s; back: "
          f"{firsts[5]['time'] - events['back']:.1f} s")


TORCHRUN_ROUNDS = 60


def torchrun_agent(out: Path, host: str, port: int, log: Path):
    """One node of an elastic torchrun job (1 to 2 nodes of 2 ranks, rendezvous at 127.0.0.1:``port``): its agent,
    running tests/workers/elastic_worker.py as ``host``. The rendezvous notices a lost node within about 3 s."""
    env = dict(os.environ, **ROOT_ENV, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PRUNEX_TIMEOUT_S=str(STALL_TIMEOUT_S),
               PX_TEST_HOST=host, OMP_NUM_THREADS="1")
    cmd = [str(BIN / "torchrun"), "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"px-elastic-{port}",
           "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
           "--monitor-interval", "0.5"] + python_cmd("elastic_worker.py", str(out), str(TORCHRUN_ROUNDS), "0.1")[1:]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def running(pids) -> list:
    return [p for p in pids if Path(f"/proc/{p}").exists()]


def test_under_torchrun_a_lost_rank_or_node_costs_a_restart_from_the_node_commits_and_a_new_node_joins(tmp_path):
    """torchrun's agents restart every worker on a change of nodes, or when a worker dies: the new workers go on
    from what their predecessors committed in the node's shared memory, not from round 0 and not from a
    checkpoint. 1. One rank of node hB killed: every worker restarts, both nodes keep their state. 2. Node hB
    killed (its agent and workers): hA's workers restart and go on over one node. 3. A new node hB2 joins."""
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    logs = {h: tmp_path / f"{h}.log" for h in ("hA", "hB", "hB2")}
    agents = {"hA": torchrun_agent(out, "hA", port, logs["hA"])}
    time.sleep(1)   # hA hosts the rendezvous
    agents["hB"] = torchrun_agent(out, "hB", port, logs["hB"])
    ranks_now = lambda n: progress(out) and progress(out)[-1]["ranks"] == n   # noqa: E731
    told = lambda: "\n".join(f"--- {h}\n{p.read_text()[-3000:]}" for h, p in logs.items() if p.exists())  # noqa
    deadline = time.monotonic() + 300
    try:
        # 1. one rank of hB killed
        wait_for("round 3", lambda: len(progress(out)) >= 3, agents["hA"], deadline, told)
        first_pids = worker_pids(out)
        os.kill(first_pids["hB"][0], signal.SIGKILL)
        rank_lost_at = len(progress(out))
        wait_for("the workers started again", lambda: len(worker_pids(out)["hA"]) == 4, agents["hA"], deadline, told)
        wait_for("two rounds after the restart", lambda: len(progress(out)) >= rank_lost_at + 3, agents["hA"],
                 deadline, told)
        # 2. node hB killed: its agent and its workers
        killed = time.time()
        os.killpg(agents["hB"].pid, signal.SIGKILL)
        for pid in running(worker_pids(out)["hB"]):
            os.kill(pid, signal.SIGKILL)
        agents["hB"].wait()
        wait_for("the survivors' rounds after the kill", lambda: ranks_now(2), agents["hA"], deadline, told)
        # 3. a new node
        listed = time.time()
        agents["hB2"] = torchrun_agent(out, "hB2", port, logs["hB2"])
        for host in ("hA", "hB2"):
            assert agents[host].wait(timeout=max(1.0, deadline - time.monotonic())) == 0, told()
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)

    finals = [json.loads((out / "final" / f"rank{r}.json").read_text()) for r in range(4)]
    assert {f["rounds"] for f in finals} == {TORCHRUN_ROUNDS}
    assert len({f["checksum"] for f in finals}) == 1, finals   # one consensus model everywhere
    assert sorted(f["host"] for f in finals) == ["hA", "hA", "hB2", "hB2"]
    assert len(worker_pids(out)["hA"]) == 8   # hA's workers started 4 times: the start, 1., 2. and 3.
    assert all(f["changes"][0]["fresh"] is False for f in finals), finals
    lines = progress(out)
    rounds = [p["round"] for p in lines]
    assert set(rounds) == set(range(1, TORCHRUN_ROUNDS + 1)), rounds   # no round skipped
    assert all(b >= a for a, b in zip(rounds, rounds[1:])), rounds     # at most the round in progress again
    # the first round of every generation of workers was checked against the reference round (the worker checks
    # that one alone, and fails the job if it differs)
    restarts = [p for p in lines if p["checked"]]
    assert [p["ranks"] for p in restarts] == [4, 4, 2, 4], restarts
    assert restarts[1]["round"] >= rank_lost_at and restarts[2]["round"] >= restarts[1]["round"] + 2, restarts
    leftover = list(Path(node_commits.SHM).glob(f"{node_commits.PREFIX}px-elastic-{port}-*"))
    assert not leftover, leftover   # the job's end cleared the commits
    print(f"torchrun: killed node: {restarts[2]['time'] - killed:.1f} s to the next round; new node: "
          f"{restarts[3]['time'] - listed:.1f} s to the first round over 2 nodes")


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
