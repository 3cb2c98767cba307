"""What a lost node costs: elastic training against a restart from the last checkpoint, side by side.

    python benchmarks/bench_elastic.py --seeds 0,1,2 [--kill-at 6] [--back-at 14] [--out FILE]

Two hosts × 2 ranks on this machine (``localhost`` and ``127.0.0.1``: Horovod treats them as two hosts), the same
``prunex-hvd train`` job (resnet_small on the digits at 8×8, a round every 3 steps, a checkpoint every round) run
three ways per seed:

* **clean**: ``--elastic`` under ``horovodrun``'s elastic mode, no fault;
* **elastic**: the same, both ranks of host 127.0.0.1 killed (SIGKILL) once round ``--kill-at`` is logged and the host
  taken off the discovery list; listed again once round ``--back-at`` is logged. Lost: seconds from the kill to the
  next round the survivors log; rejoin: seconds from the listing to the first round over both nodes again;
* **restart**: the job without ``--elastic`` under ``horovodrun --gloo`` (``--timeout 30``); the same kill ends it
  (the watchdog), and it is launched again with ``--resume`` on both hosts. Lost: seconds from the kill to the first
  round the resumed job logs.

Seconds are observed by polling ``metrics.jsonl`` every 0.05 s. The final accuracy of the elastic run is compared with
the clean run of the same seed. Prints one JSON document."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchjson import emit

BIN = Path(sys.executable).parent
TRAIN = ["--model", "resnet_small", "--dataset", "digits", "--image-size", "8", "--epochs", "6", "--local-steps", "3",
         "--batch-size", "16", "--threads", "1", "--checkpoint-every", "1"]
ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONUNBUFFERED": "1",
       "HOROVOD_GLOO_TIMEOUT_SECONDS": "30"}


def rounds(run: Path) -> list:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") in ("round", "nodes"):
            out.append(rec)
    return out


class Job:
    """One launch in its own process group; ``pids`` names every process it started, by host."""

    def __init__(self, work: Path, cmd: list, elastic: bool):
        self.work, self.pids_dir = work, work / f"pids{time.monotonic_ns()}"
        self.pids_dir.mkdir(parents=True)
        self.hosts = work / "hosts.txt"
        self.hosts.write_text("localhost:2\n127.0.0.1:2\n")
        mark = f'touch {self.pids_dir}/$HOROVOD_HOSTNAME.$$ && exec "$@"'
        wrapped = ["sh", "-c", mark, "sh"] + cmd
        if elastic:
            discover = work / "discover.sh"
            discover.write_text(f"#!/bin/sh\ncat {self.hosts}\n")
            discover.chmod(0o755)
            launch = [str(BIN / "horovodrun"), "-np", "4", "--min-np", "2", "--max-np", "4",
                      "--blacklist-cooldown-range", "1", "2", "--host-discovery-script", str(discover)] + wrapped
        else:
            launch = [str(BIN / "horovodrun"), "--gloo", "-np", "4", "-H", "localhost:2,127.0.0.1:2"] + wrapped
        env = dict(os.environ, **ENV)
        env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
        self.log = open(work / f"log{time.monotonic_ns()}.txt", "w")
        self.proc = subprocess.Popen(launch, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def pids(self, host: str) -> list:
        return [int(p.name.rsplit(".", 1)[1]) for p in self.pids_dir.iterdir() if p.name.rsplit(".", 1)[0] == host]

    def kill_host(self, host: str = "127.0.0.1") -> float:
        self.hosts.write_text("localhost:2\n")
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return time.time()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise


def until(predicate, job: Job, timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():
        if job.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job ended or stalled (exit {job.proc.poll()}); see {job.log.name}")
        time.sleep(0.05)
    return time.time()


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def clean(work: Path, seed: int) -> dict:
    run = work / f"clean{seed}"
    job = Job(work, [str(BIN / "prunex-hvd"), "train", "--elastic", *TRAIN, "--seed", str(seed), "--out", str(run)],
              elastic=True)
    assert job.wait(600) == 0, job.log.name
    s = summary(run)
    return {"final_test_acc": s["final_test_acc"], "rounds": s["rounds"], "wall_s": s["wall_s"]}


def elastic(work: Path, seed: int, kill_at: int, back_at: int) -> dict:
    run = work / f"elastic{seed}"
    job = Job(work, [str(BIN / "prunex-hvd"), "train", "--elastic", *TRAIN, "--seed", str(seed), "--out", str(run)],
              elastic=True)
    until(lambda: sum(r["event"] == "round" for r in rounds(run)) >= kill_at, job)
    killed = job.kill_host()
    seen = until(lambda: any(r["event"] == "round" and r["ranks"] == 2 for r in rounds(run)), job)
    until(lambda: rounds(run)[-1].get("round", 0) >= back_at, job)
    job.hosts.write_text("localhost:2\n127.0.0.1:2\n")
    listed = time.time()
    def rejoined() -> bool:
        lines = rounds(run)
        grown = [k for k, r in enumerate(lines) if r["event"] == "nodes" and r["ranks"] == 4]
        return bool(grown) and any(r["event"] == "round" for r in lines[grown[-1]:])
    joined = until(rejoined, job)
    assert job.wait(600) == 0, job.log.name
    s = summary(run)
    lost_round = next(r for r in rounds(run) if r["event"] == "nodes")
    return {"lost_s": seen - killed, "rejoin_s": joined - listed, "lost_at_round": lost_round["round"],
            "final_test_acc": s["final_test_acc"], "rounds": s["rounds"], "wall_s": s["wall_s"],
            "changes": s["elastic_changes"]}


def restart(work: Path, seed: int, kill_at: int) -> dict:
    run = work / f"restart{seed}"
    cmd = [str(BIN / "prunex-hvd"), "train", *TRAIN, "--seed", str(seed), "--timeout", "30", "--out", str(run)]
    job = Job(work, cmd, elastic=False)
    until(lambda: len(rounds(run)) >= kill_at, job)
    killed = job.kill_host()
    job.wait(120)   # the watchdog ends it
    ended = time.time()
    old_file = (run / "metrics.jsonl").stat().st_ino   # a resume rewrites the file (a new inode), then appends
    saved_step = json.loads((run / "checkpoint.json").read_text())["tag"]
    job = Job(work, cmd + ["--resume"], elastic=False)
    seen = until(lambda: (run / "metrics.jsonl").stat().st_ino != old_file and
                 any(r["step"] > saved_step for r in rounds(run)), job)
    resumed_at = rounds(run)[-1]["round"]
    assert job.wait(600) == 0, job.log.name
    s = summary(run)
    return {"lost_s": seen - killed, "ended_s": ended - killed, "resumed_at_round": resumed_at,
            "final_test_acc": s["final_test_acc"], "rounds": s["rounds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--kill-at", type=int, default=6)
    p.add_argument("--back-at", type=int, default=14)
    p.add_argument("--gloo-timeout", type=int, default=30,
                   help="HOROVOD_GLOO_TIMEOUT_SECONDS: how long Gloo waits for a silent peer (Horovod's default 30)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ENV["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(args.gloo_timeout)
    seeds = [int(s) for s in args.seeds.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_elastic") as tmp:
        for seed in seeds:
            work = Path(tmp) / f"seed{seed}"
            work.mkdir()
            row = {"seed": seed, "clean": clean(work, seed), "elastic": elastic(work, seed, args.kill_at, args.back_at),
                   "restart": restart(work, seed, args.kill_at)}
            row["acc_diff_points"] = 100 * (row["elastic"]["final_test_acc"] - row["clean"]["final_test_acc"])
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]   # noqa: E731
    emit({"bench": "elastic", "train": TRAIN, "kill_at": args.kill_at, "back_at": args.back_at,
          "gloo_timeout_s": int(ENV["HOROVOD_GLOO_TIMEOUT_SECONDS"]), "seeds": results,
          "median": {"elastic_lost_s": med([r["elastic"]["lost_s"] for r in results]),
                     "elastic_rejoin_s": med([r["elastic"]["rejoin_s"] for r in results]),
                     "restart_lost_s": med([r["restart"]["lost_s"] for r in results]),
                     "max_abs_acc_diff_points": max(abs(r["acc_diff_points"]) for r in results)}}, args.out)


if __name__ == "__main__":
    main()
