"""What a lost node costs: elastic training against a restart from the last checkpoint, side by side.

    sudo python benchmarks/bench_elastic.py --seeds 0,1,2 [--kill-at 6] [--back-at 14] [--gloo-timeout 10] \
        [--timeout 10] [--local] [--scenarios clean,elastic,...] [--work DIR] [--out FILE]

Two hosts × 2 ranks on the emulated cluster of ``emulated_cluster.py`` (hosts pxh0 and pxh1 as network namespaces
behind one switch, unshaped; horovodrun in the launcher's namespace reaches them through ``cluster/nsrsh`` as its
``ssh``; a torchrun agent runs in each host's namespace), or with ``--local`` on this machine's ``localhost`` and
``127.0.0.1`` (Horovod treats them as two hosts; two torchrun agents; no root needed). The same ``prunex-hvd
train`` job (resnet_small on the digits at 8×8, a round every 3 steps, a checkpoint every round) runs these ways
per seed:

* **clean**: ``--elastic`` under ``horovodrun``'s elastic mode, no fault;
* **elastic**: the same; every process of the second host killed (SIGKILL) once round ``--kill-at`` is logged and
  the host taken off the discovery list; listed again once round ``--back-at`` is logged. Lost: seconds from the
  kill to the next round the survivors log; rejoin: seconds from the listing to the first round over both nodes;
* **stall** (emulated cluster only): the same, but the second host's link stalls at round ``--kill-at`` (its switch
  port drops every frame) and it is taken off the list; its link comes back at round ``--back-at`` and it is listed
  again. Lost: seconds from the stall to the next round the survivors log (the collective timeout ``--timeout``,
  then the cut-off ranks leave);
* **restart**: the job without ``--elastic`` under ``horovodrun --gloo`` (``--timeout``); the same kill ends it (the
  watchdog), and it is launched again with ``--resume`` on both hosts. Lost: seconds from the kill to the first
  round the resumed job logs;
* **torchrun_clean**, **torchrun**, **torchrun_stall**: clean, elastic and stall under ``torchrun --nnodes 1:2``
  (c10d rendezvous at the first host, ``--max-restarts 10``): the kill takes the second host's agent with its
  workers, and the host comes back as a new agent started there (after a stall, if its agent gave up).

Seconds are observed by polling ``metrics.jsonl`` every 0.05 s. The final accuracy of each faulted run is compared
with the clean run of its launcher and seed. Prints one JSON document."""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
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
HERE = Path(__file__).resolve().parent
TRAIN = ["--model", "resnet_small", "--dataset", "digits", "--image-size", "8", "--epochs", "10", "--local-steps", "3",
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


def load_cluster():
    spec = importlib.util.spec_from_file_location("emulated_cluster", HERE / "emulated_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Job:
    """One launch in its own process group, on two hosts: the emulated cluster's pxh0 and pxh1 (``cluster``, the
    module emulated_cluster.py, built), or localhost and 127.0.0.1."""

    def __init__(self, work: Path, cmd: list, elastic: bool, cluster=None):
        self.cluster = cluster
        self.names = ("pxh0", "pxh1") if cluster else ("localhost", "127.0.0.1")
        self.pids_dir = work / f"pids{time.monotonic_ns()}"
        self.pids_dir.mkdir(parents=True)
        self.hosts = work / "hosts.txt"
        self.list_hosts(2)
        mark = f'touch {self.pids_dir}/$HOROVOD_HOSTNAME.$$ && exec "$@"'
        wrapped = cmd if cluster else ["sh", "-c", mark, "sh"] + cmd
        prefix, nic, env = [], [], dict(os.environ, **ENV)
        if cluster:
            prefix, nic, more_env = cluster.horovodrun_in_cluster(str(work), list(self.names))
            env.update(more_env)
        if elastic:
            discover = work / "discover.sh"
            discover.write_text(f"#!/bin/sh\ncat {self.hosts}\n")
            discover.chmod(0o755)
            launch = [str(BIN / "horovodrun"), "-np", "4", "--min-np", "2", "--max-np", "4",
                      "--blacklist-cooldown-range", "1", "2", "--host-discovery-script", str(discover)] + nic + wrapped
        else:
            launch = [str(BIN / "horovodrun"), "--gloo", "-np", "4", "-H", ",".join(f"{h}:2" for h in self.names)] \
                + nic + wrapped
        env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
        self.log = open(work / f"log{time.monotonic_ns()}.txt", "w")
        self.proc = subprocess.Popen(prefix + launch, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def list_hosts(self, n: int) -> float:
        self.hosts.write_text("".join(f"{h}:2\n" for h in self.names[:n]))
        return time.time()

    def kill_host(self) -> float:
        """Every process of the second host killed; it is taken off the list first."""
        self.list_hosts(1)
        if self.cluster:
            self.cluster.kill_namespace_processes([self.names[1]])
        else:
            for p in self.pids_dir.iterdir():
                if p.name.rsplit(".", 1)[0] == self.names[1]:
                    try:
                        os.kill(int(p.name.rsplit(".", 1)[1]), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        return time.time()

    def stall_host(self, stalled: bool) -> float:
        """The second host's link stalls (taken off the list) or comes back (listed)."""
        if stalled:
            self.list_hosts(1)
        self.cluster.set_link(1, up=not stalled, hosts=2)
        return self.list_hosts(2) if not stalled else time.time()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise


class TorchrunJob:
    """An elastic torchrun job: one agent per host (2 ranks each; ``--nnodes 1:2``), the c10d rendezvous at the
    first host's address; on the emulated cluster each agent runs in its host's namespace, else both on this
    machine. The rendezvous notices a lost agent within 3 s (``keep_alive_*``) and closes a round 2 s after its
    first nodes are in (``last_call_timeout``)."""

    def __init__(self, work: Path, cmd: list, cluster=None):
        self.cluster, self.work, self.cmd = cluster, work, cmd
        host = f"{cluster.SUBNET}.1" if cluster else "127.0.0.1"
        self.rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{29500 + os.getpid() % 400}",
                           "--rdzv-id", f"bench{time.monotonic_ns()}"]
        self.agents: dict = {}
        self.start(0)
        time.sleep(1)   # the first agent hosts the rendezvous
        self.start(1)
        self.proc, self.log = self.agents[0]

    def start(self, k: int) -> float:
        prefix, args, env = [], [], dict(os.environ, **ENV, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        if self.cluster:
            prefix, args, more_env = self.cluster.torchrun_on_host(k)
            env.update(more_env)
        # is_host: the first agent serves the rendezvous (said, not guessed from the machine's host name)
        conf = f"last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,is_host={int(k == 0)}"
        launch = [str(BIN / "torchrun"), "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "10",
                  "--monitor-interval", "0.5", "--rdzv-conf", conf] + self.rendezvous + args + self.cmd
        log = open(self.work / f"torchrun{k}-{time.monotonic_ns()}.txt", "w")
        self.agents[k] = (subprocess.Popen(prefix + launch, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True), log)
        return time.time()

    def kill_host(self) -> float:
        """The second host's agent and workers killed."""
        agent = self.agents[1][0]
        if self.cluster:
            self.cluster.kill_namespace_processes(["pxh1"])
        else:
            workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
            for pid in [agent.pid] + [int(w) for w in workers]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        killed = time.time()
        agent.wait()
        return killed

    def list_hosts(self, n: int) -> float:
        """The second host's agent started again (a node that comes back)."""
        return self.start(1)

    def stall_host(self, stalled: bool) -> float:
        """The second host's link stalls, or comes back (and its agent is started again if it gave up)."""
        self.cluster.set_link(1, up=not stalled, hosts=2)
        if not stalled and self.agents[1][0].poll() is not None:
            return self.start(1)
        return time.time()

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        codes = []
        for agent, _ in self.agents.values():
            try:
                codes.append(agent.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for other, _ in self.agents.values():
                    if other.poll() is None:
                        os.killpg(other.pid, signal.SIGKILL)
                raise
        return codes[0]


def until(predicate, job: Job, timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():
        if job.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job ended or stalled (exit {job.proc.poll()}):\n{told(job)}")
        time.sleep(0.05)
    return time.time()


def told(job) -> str:
    """The end of what the job's launcher(s) printed."""
    logs = [log for _, log in job.agents.values()] if isinstance(job, TorchrunJob) else [job.log]
    out = []
    for log in logs:
        log.flush()
        out.append(f"--- {log.name}\n" + Path(log.name).read_text()[-4000:])
    return "\n".join(out)


def finished(job) -> None:
    code = job.wait(600)
    if code != 0:
        raise RuntimeError(f"the job ended with exit {code}:\n{told(job)}")


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def elastic_job(work: Path, run: Path, seed: int, cluster, launcher: str):
    cmd = [str(BIN / "prunex-hvd"), "train", "--elastic", *TRAIN, "--seed", str(seed), "--out", str(run)]
    return TorchrunJob(work, cmd, cluster) if launcher == "torchrun" else Job(work, cmd, elastic=True, cluster=cluster)


def clean(work: Path, seed: int, cluster, launcher: str = "horovodrun") -> dict:
    run = work / f"clean-{launcher}{seed}"
    job = elastic_job(work, run, seed, cluster, launcher)
    finished(job)
    s = summary(run)
    return {"final_test_acc": s["final_test_acc"], "rounds": s["rounds"], "wall_s": s["wall_s"]}


def elastic(work: Path, seed: int, kill_at: int, back_at: int, cluster, fault: str = "kill",
            launcher: str = "horovodrun") -> dict:
    """``fault``: "kill" (every process of the host) or "stall" (its link)."""
    run = work / f"{fault}-{launcher}{seed}"
    job = elastic_job(work, run, seed, cluster, launcher)
    until(lambda: sum(r["event"] == "round" for r in rounds(run)) >= kill_at, job)
    struck = job.kill_host() if fault == "kill" else job.stall_host(True)
    seen = until(lambda: any(r["event"] == "round" and r["ranks"] == 2 for r in rounds(run)), job)
    until(lambda: rounds(run)[-1].get("round", 0) >= back_at, job)
    listed = job.list_hosts(2) if fault == "kill" else job.stall_host(False)

    def rejoined() -> bool:
        lines = rounds(run)
        grown = [k for k, r in enumerate(lines) if r["event"] == "nodes" and r["ranks"] == 4]
        return bool(grown) and any(r["event"] == "round" for r in lines[grown[-1]:])
    joined = until(rejoined, job)
    finished(job)
    s = summary(run)
    lost_round = next(r for r in rounds(run) if r["event"] == "nodes")
    return {"lost_s": seen - struck, "rejoin_s": joined - listed, "lost_at_round": lost_round["round"],
            "final_test_acc": s["final_test_acc"], "rounds": s["rounds"], "wall_s": s["wall_s"],
            "changes": s["elastic_changes"]}


def restart(work: Path, seed: int, kill_at: int, cluster, timeout: int) -> dict:
    run = work / f"restart{seed}"
    cmd = [str(BIN / "prunex-hvd"), "train", *TRAIN, "--seed", str(seed), "--timeout", str(timeout), "--out", str(run)]
    job = Job(work, cmd, elastic=False, cluster=cluster)
    until(lambda: len(rounds(run)) >= kill_at, job)
    killed = job.kill_host()
    job.wait(120)   # the watchdog ends it
    ended = time.time()
    old_file = (run / "metrics.jsonl").stat().st_ino   # a resume rewrites the file (a new inode), then appends
    saved_step = json.loads((run / "checkpoint.json").read_text())["tag"]
    job = Job(work, cmd + ["--resume"], elastic=False, cluster=cluster)
    seen = until(lambda: (run / "metrics.jsonl").stat().st_ino != old_file and
                 any(r["step"] > saved_step for r in rounds(run)), job)
    resumed_at = rounds(run)[-1]["round"]
    finished(job)
    s = summary(run)
    return {"lost_s": seen - killed, "ended_s": ended - killed, "resumed_at_round": resumed_at,
            "final_test_acc": s["final_test_acc"], "rounds": s["rounds"]}


# each scenario: (work dir, seed, the command line's args, the cluster or None) -> its row
SCENARIOS = {
    "clean": lambda w, seed, a, c: clean(w, seed, c),
    "elastic": lambda w, seed, a, c: elastic(w, seed, a.kill_at, a.back_at, c),
    "restart": lambda w, seed, a, c: restart(w, seed, a.kill_at, c, a.timeout),
    "stall": lambda w, seed, a, c: elastic(w, seed, a.kill_at, a.back_at, c, fault="stall"),
    "torchrun_clean": lambda w, seed, a, c: clean(w, seed, c, launcher="torchrun"),
    "torchrun": lambda w, seed, a, c: elastic(w, seed, a.kill_at, a.back_at, c, launcher="torchrun"),
    "torchrun_stall": lambda w, seed, a, c: elastic(w, seed, a.kill_at, a.back_at, c, fault="stall",
                                                    launcher="torchrun"),
}
FAULTS = {"elastic": "clean", "stall": "clean", "torchrun": "torchrun_clean", "torchrun_stall": "torchrun_clean"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--kill-at", type=int, default=6)
    p.add_argument("--back-at", type=int, default=14)
    p.add_argument("--gloo-timeout", type=int, default=30,
                   help="HOROVOD_GLOO_TIMEOUT_SECONDS: how long Gloo waits for a silent peer (Horovod's default 30)")
    p.add_argument("--timeout", type=int, default=30,
                   help="the library's timeout (PRUNEX_TIMEOUT_S / --timeout): the watchdog's under a restart, a "
                        "collective's under elastic training")
    p.add_argument("--local", action="store_true", help="localhost and 127.0.0.1 instead of the emulated cluster")
    p.add_argument("--scenarios", default=None,
                   help=f"a comma-separated subset of {','.join(SCENARIOS)} (default: all; the stalls need the "
                        "emulated cluster)")
    p.add_argument("--work", default=None, help="keep the runs and the launchers' logs in this folder")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ENV.update(HOROVOD_GLOO_TIMEOUT_SECONDS=str(args.gloo_timeout), PRUNEX_TIMEOUT_S=str(args.timeout))
    cluster = None if args.local else load_cluster()
    if cluster is not None:
        why = cluster.preflight()
        if why:
            sys.exit(f"bench_elastic: the emulated cluster cannot be built: {why} (--local runs without it)")
        cluster.teardown()
        cluster.build(2, 1500)
    seeds = [int(s) for s in args.seeds.split(",")]
    chosen = args.scenarios.split(",") if args.scenarios else list(SCENARIOS)
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        sys.exit(f"bench_elastic: unknown scenario(s) {sorted(unknown)}; there are {list(SCENARIOS)}")
    if cluster is None:
        chosen = [c for c in chosen if "stall" not in c]   # a stalled link needs the emulated cluster
    results = []
    try:
        with (contextlib.nullcontext(args.work) if args.work else tempfile.TemporaryDirectory(prefix="bench_elastic")) \
                as tmp:
            for seed in seeds:
                work = Path(tmp) / f"seed{seed}"
                work.mkdir(parents=True)
                row = {"seed": seed}
                for name in chosen:
                    row[name] = SCENARIOS[name](work, seed, args, cluster)
                for fault, baseline in FAULTS.items():
                    if fault in row and baseline in row:
                        row[f"{fault}_acc_diff_points"] = 100 * (row[fault]["final_test_acc"]
                                                                  - row[baseline]["final_test_acc"])
                results.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        if cluster is not None:
            cluster.teardown()
    med = lambda xs: sorted(xs)[len(xs) // 2]   # noqa: E731
    median = {}
    for name in chosen:
        for key in ("lost_s", "rejoin_s"):
            if key in results[0][name]:
                median[f"{name}_{key}"] = med([r[name][key] for r in results])
    for fault in FAULTS:
        diffs = [r[f"{fault}_acc_diff_points"] for r in results if f"{fault}_acc_diff_points" in r]
        if diffs:
            median[f"{fault}_max_abs_acc_diff_points"] = max(map(abs, diffs))
            median[f"{fault}_mean_acc_diff_points"] = sum(diffs) / len(diffs)
    emit({"bench": "elastic", "hosts": "emulated cluster (network namespaces)" if cluster else "localhost, 127.0.0.1",
          "train": TRAIN, "kill_at": args.kill_at, "back_at": args.back_at,
          "gloo_timeout_s": args.gloo_timeout, "timeout_s": args.timeout, "seeds": results, "median": median},
         args.out)


if __name__ == "__main__":
    main()
