"""Faults injected for real into 4-rank jobs on 2 emulated nodes (tests/workers/fault_worker.py): NaN in one
rank's data, one rank killed with SIGKILL or stopped with SIGSTOP in the middle of a consensus round, a
truncated checkpoint file, ranks at different step counts. Every fault must end the job on every rank, loudly,
within a bound, naming the rank at fault, and a resume from the last checkpoint must end bit for bit where an
uninterrupted run ends."""
import os
import re
import shutil
import signal
import time

import pytest

from launching import have_horovod, horovodrun, mpirun, needs_horovod, needs_mpirun, python_cmd, run, worker_results
from shared_launches import register
from training_job import NODES2, assert_same_run, metrics, train

pytestmark = [pytest.mark.launch, needs_mpirun]

FAULT = ["python", "fault_worker.py"]
# A launch on this 2-core host can take 20-40 s under load; a timeout well above the ranks' start-up skew
TIMEOUT_S = 30
# A stall is seen only when the timeout runs out, so the stalled jobs wait it out: theirs is shorter (the watchdog
# is armed only inside collectives, which the ranks enter together after init: the launch's start-up never counts)
STALL_TIMEOUT_S = 15
SMALL_JOB = ["--model", "resnet_small", "--dataset", "digits", "--image-size", "8", "--epochs", "1",
             "--local-steps", "3", "--batch-size", "16", "--threads", "1"]
SMALL = SMALL_JOB + ["--timeout", str(TIMEOUT_S)]


def fault_cmd(out, fault, rank, at_round):
    return python_cmd("fault_worker.py", "--fault", fault, "--rank", str(rank), "--round", str(at_round),
                      "--out", str(out), "--")


def manifest_tag(out):
    import json
    return json.loads((out / "checkpoint.json").read_text())["tag"]


def cleanup(out):
    """A stopped rank may outlive its job: kill it (SIGKILL works on a stopped process)."""
    pid = out / "fault.pid"
    if pid.exists():
        try:
            os.kill(int(pid.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def since_fault(out):
    """Seconds from the fault (the faulty rank wrote fault.pid just before it) to now."""
    return time.time() - (out / "fault.pid").stat().st_mtime


# Slack on top of the timeout for the watchdog's own steps (a heartbeat, a query, a grace for the others to
# hear) and the launcher's teardown, on a loaded 2-core host
SLACK_S = 45


def watchdog_lines(stdout):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"\[rank (\d+)\] prunex_hvd watchdog: (.*)", stdout)}


def test_nan_then_kill_then_resume_ends_bit_for_bit_like_the_uninterrupted_run(full_run, tmp_path):
    """One job through three faults. (1) NaN in one batch of rank 1 before round 3: every rank stops in round 3
    with the same error (naming rank 1's node: node_sync shares its gradients), the round-2 checkpoint untouched. (2) A copy of it with one rank file truncated is
    refused by every rank. (3) The resume runs on and rank 3 is killed (SIGKILL) in the middle of round 6: the
    job ends within the bound, rank 3 named. (4) A last resume ends exactly where the uninterrupted run ends."""
    ref, _ = full_run
    out = tmp_path / "run"

    proc = train(out, env_vars=["FAULT_STEP=20"], cmd=fault_cmd(tmp_path, "nan", 1, 3))   # round 3 is at step 21
    assert proc.returncode != 0
    assert proc.stdout.count("prunex-hvd: error: consensus round 3: inf or NaN in the float buffers (BatchNorm "
                             "running statistics), conv1.weight, ") == 4, proc.stdout[-4000:]
    # the recipe's node_sync spreads rank 1's NaN gradient to its node (ranks 0 and 1), and the error says why
    assert proc.stdout.count("from θ + u of ranks 0,1 (node_sync: the ranks of a node average their gradients, so "
                             "one rank's bad batch reaches every rank of its node). Every rank stops here with the "
                             "state of round 2") == 4, proc.stdout[-4000:]
    assert manifest_tag(out) == 14 and len(list((out / "ckpt").glob("tag00000014.rank*.pt"))) == 4
    assert [r["round"] for r in metrics(out)] == [1, 2]

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    victim = bad / "ckpt" / "tag00000014.rank00002.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 3])
    proc = train(bad, "--resume")
    assert proc.returncode != 0
    assert proc.stdout.count("cannot resume from") == 4, proc.stdout[-4000:]
    assert proc.stdout.count("rank00002.pt is corrupt: its SHA-256 differs") == 4

    proc = train(out, "--resume", "--timeout", str(TIMEOUT_S), cmd=fault_cmd(tmp_path, "kill", 3, 6))
    took = since_fault(tmp_path)
    assert proc.returncode != 0
    assert re.search(r"rank 3 died \(its process is gone\)|process rank 3 with PID \d+ .*exited on signal 9",
                     proc.stdout), proc.stdout[-4000:]
    assert took < SLACK_S, took                        # a death needs no timeout to be seen
    print(f"mpirun, rank 3 killed mid-round: the job ended {took:.1f} s after the kill")
    assert manifest_tag(out) == 35                     # round 5's checkpoint; round 6 was never completed

    proc = train(out, "--resume")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert_same_run(ref, out)


UNEVEN = {f"{sync}-{who}": (rank, sync == "node-sync") for sync in ("alone", "node-sync")
          for who, rank in (("a-leader-ahead", 2), ("a-non-leader-ahead", 3))}
# the four cases one after the other in the shared 2 × 2 launch (each refusal is agreed: the ranks stay in step)
UNEVEN_CASE = register("mpirun-2x2", "uneven", "fault_worker", "--fault", "uneven", "--uneven",
                       ",".join(f"{name}:{rank}" + (":node-sync" if sync else "")
                                for name, (rank, sync) in UNEVEN.items()))


@pytest.mark.parametrize("odd_rank", [2, 3], ids=["a-leader-ahead", "a-non-leader-ahead"])
@pytest.mark.parametrize("node_sync", [False, True], ids=["alone", "node-sync"])
def test_ranks_at_different_step_counts_are_refused_in_the_round(shared_launch, request, node_sync, odd_rank):
    """One rank takes a step more than the others (2 nodes × 2). Stepping alone, the round's verdict compares the
    counts. With node_sync the extra step's gradient average would meet its node's round: the guard before both
    refuses it instead, on every rank, whether that rank leads its node or not."""
    proc, out = shared_launch("mpirun-2x2")
    worker_results(proc, out, "fault", case=UNEVEN_CASE)
    out = out / UNEVEN_CASE
    others = ",".join(str(r) for r in range(4) if r != odd_rank)
    for r in range(4):
        text = (out / request.node.callspec.id / f"error.rank{r}.txt").read_text()
        if not node_sync:
            assert f"consensus round 1: the ranks took different numbers of optimizer steps (5 on ranks {others}; " \
                   f"6 on rank {odd_rank})" in text, text
            continue
        assert "node_sync: the ranks are not at the same point (" in text, text
        assert f"rank {odd_rank} in a local step after 5 steps" in text, text
        # the node's non-leader sees its node (it raises before the leaders sum); everyone else the whole job
        seen = f"rank {odd_rank ^ 1}" if r // 2 == odd_rank // 2 and r % 2 else f"ranks {others}"
        assert f"{seen} at consensus round 1 after 5 steps" in text, text


def stalled_job(tmp_path, launcher, rank):
    cmd = fault_cmd(tmp_path, "stop", rank, 2) + ["train", *SMALL_JOB, "--timeout", str(STALL_TIMEOUT_S),
                                                  "--out", str(tmp_path / "run")]
    full = mpirun(4, cmd, NODES2) if launcher == "mpirun" else horovodrun(4, "localhost:2,127.0.0.1:2", cmd)
    try:
        proc = run(full, timeout=240)
        assert (tmp_path / "fault.pid").exists(), "the job ended before the fault:\n" + proc.stdout[-6000:]
        return proc, since_fault(tmp_path)
    finally:
        cleanup(tmp_path)


STALLS = [("mpirun", 3), pytest.param("horovodrun", 0, marks=needs_horovod)]


def killed_in_flight_job(tmp_path):
    cmd = fault_cmd(tmp_path, "kill-in-flight", 2, 2) + ["train", *SMALL, "--overlap", "on", "--freeze-round", "0",
                                                         "--out", str(tmp_path / "run")]
    proc = run(mpirun(4, cmd, NODES2), timeout=240)
    return proc, since_fault(tmp_path)


def killed_under_horovodrun_job(tmp_path):
    cmd = fault_cmd(tmp_path, "kill", 3, 2) + ["train", *SMALL, "--out", str(tmp_path / "run")]
    proc = run(horovodrun(4, "localhost:2,127.0.0.1:2", cmd), timeout=240)
    return proc, since_fault(tmp_path)


# the killed jobs' tests: {test: (its job, whether it needs Horovod)}
KILLED = {"test_a_rank_killed_with_an_exchange_in_flight_is_named": (killed_in_flight_job, False),
          "test_a_killed_rank_under_horovodrun_is_named": (killed_under_horovodrun_job, True)}


@pytest.fixture(scope="module")
def fault_jobs(request, tmp_path_factory):
    """The jobs of the stall and kill tests below that this session runs, launched on first use: {(launcher,
    rank) or test name: the future of (the job, seconds from the fault to its end)}. A stalled job spends most of
    its time waiting for its timeout: the stalled jobs run at the same time, and the killed ones start once the
    stalled ones wait (or have ended), in that wait."""
    from concurrent.futures import ThreadPoolExecutor
    tests = {item.originalname for item in request.session.items if getattr(item, "module", None) is not None
             and item.module.__name__ == __name__}
    stalls = [("mpirun", 3)] + ([("horovodrun", 0)] if have_horovod() else [])
    stalls = stalls if "test_a_stalled_rank_is_named_by_every_other_rank" in tests else []
    kills = [test for test, (_, hvd) in KILLED.items() if test in tests and (have_horovod() or not hvd)]
    folders = {case: tmp_path_factory.mktemp(f"stalled-{case[0]}") for case in stalls}
    with ThreadPoolExecutor(max(1, len(stalls) + len(kills))) as pool:
        jobs = {case: pool.submit(stalled_job, folders[case], *case) for case in stalls}
        while not all(jobs[case].done() or (folders[case] / "fault.pid").exists() for case in stalls):
            time.sleep(0.2)
        for test in kills:
            jobs[test] = pool.submit(KILLED[test][0], tmp_path_factory.mktemp(test[len("test_"):][:30]))
        yield jobs


@pytest.mark.parametrize("launcher,rank", STALLS)
def test_a_stalled_rank_is_named_by_every_other_rank(fault_jobs, launcher, rank):
    """Rank R stops (SIGSTOP) in the middle of round 2: its process lives on, the launcher sees nothing. Every
    other rank's watchdog stops the job after the timeout, naming it (rank 0 stalled: its hub is silent)."""
    proc, took = fault_jobs[launcher, rank].result()
    assert proc.returncode != 0
    said = watchdog_lines(proc.stdout)
    others = set(range(4)) - {rank}
    assert others <= set(said), proc.stdout[-4000:]
    if rank == 0:   # no hub: each rank finds rank 0 silent on its own
        for r in others:
            assert re.search(rf"consensus round 2 did not complete within {STALL_TIMEOUT_S} s; rank 0 does not "
                             r"answer", said[r])
    else:
        # whoever times out first names rank 3; the rest stop with one of them (two ranks timing out within
        # the same moment each name rank 3 themselves)
        first = [r for r in others if "which reports" not in said[r]]
        assert first, said
        for r in first:
            assert re.search(rf"consensus round 2 did not complete within {STALL_TIMEOUT_S} s; .*rank 3 is "
                             r"silent for \d+ s \(stopped or hung\)", said[r]), said
        relayed = "|".join(map(str, first))
        assert all(re.search(rf"stopping with rank ({relayed}), which reports", said[r])
                   for r in others - set(first)), said
    assert STALL_TIMEOUT_S / 2 < took < STALL_TIMEOUT_S + SLACK_S, took   # waited for the timeout, not much longer
    print(f"{launcher}, rank {rank} stopped mid-round: the job ended {took:.1f} s after the stop")


def test_a_rank_killed_with_an_exchange_in_flight_is_named(fault_jobs):
    """overlap (the masks chosen at the start: every round overlaps): rank 2, node 1's leader, is killed while
    round 2's inter-node exchange is in flight (its local steps run). Rank 0 waits for that exchange when round 3
    folds it in: the watchdog names the dead rank and the job ends within the bound, not at the timeout."""
    proc, took = fault_jobs["test_a_rank_killed_with_an_exchange_in_flight_is_named"].result()
    assert proc.returncode != 0
    assert re.search(r"rank 2 died \(its process is gone\)|process rank 2 with PID \d+ .*exited on signal 9",
                     proc.stdout), proc.stdout[-4000:]
    assert took < SLACK_S, took
    print(f"mpirun, rank 2 killed with an exchange in flight: the job ended {took:.1f} s after the kill")


@needs_horovod
def test_a_killed_rank_under_horovodrun_is_named(fault_jobs):
    """Rank 3 killed (SIGKILL) in the middle of round 2 under horovodrun --gloo (torch gloo groups): the
    others' collectives fail, the watchdog names the dead rank, the job ends within seconds."""
    proc, took = fault_jobs["test_a_killed_rank_under_horovodrun_is_named"].result()
    assert proc.returncode != 0
    said = watchdog_lines(proc.stdout)
    # rank 3 named: by the watchdogs, unless horovodrun saw the death and ended the others first
    assert all(re.search(r"rank 3 died \(its process is gone\)", s) for s in said.values()), proc.stdout[-4000:]
    assert "Process 3 exit with status code 137" in proc.stdout, proc.stdout[-4000:]
    assert took < SLACK_S, took
    print(f"horovodrun, rank 3 killed mid-round: the job ended {took:.1f} s after the kill")
