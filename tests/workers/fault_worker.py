"""Faults injected for real into one rank of a job: `prunex-hvd train` itself, with one hook on the faulty rank.

    mpirun -np 4 python fault_worker.py --fault kill|stop|nan --rank R --round K --out DIR -- train ARGS...
    mpirun -np 4 python fault_worker.py --fault uneven --uneven NAME:R[:node-sync],... --out DIR

kill  rank R sends itself SIGKILL in consensus round K, after the round's first collective (mid-round)
stop  rank R sends itself SIGSTOP there instead (a stalled rank: its process is alive, it never arrives)
kill-in-flight  with --overlap: rank R sends itself SIGKILL in the first local step after round K started,
      while round K's inter-node exchange is in flight
nan   one input batch of rank R, in the local steps just before round K, is NaN: θ and the BatchNorm statistics
      of that rank turn NaN through a real forward/backward/step, and round K meets them
uneven  no training CLI: in each case NAME of --uneven, rank R's data shard holds one more batch, every rank
      steps through its shard and calls consensus() at the end of the epoch (ranks at different step counts);
      with node-sync the recipe's node_sync (a node's ranks average their gradients every step), else every rank
      steps alone

The faulty rank writes OUT/fault.pid (its pid) before the fault, so the test can clean up a stopped process.
"""
import argparse
import os
import signal
import sys

import torch

import worker_io


def inject(fault: str, at_round: int, out: str) -> None:
    """Install the fault in this process (the faulty rank only)."""
    from prunex_hvd.app import data
    from prunex_hvd.engine import admm, hsadmm

    def mark():
        with open(os.path.join(out, "fault.pid"), "w") as f:
            f.write(str(os.getpid()))

    if fault in ("kill", "stop"):
        state = {"round": 0}
        round_fn, candidate = hsadmm.HSADMM._round, admm.node_candidate

        def tracked_round(self, steps):
            state["round"] = self.round + 1
            return round_fn(self, steps)

        def candidate_then_fault(*args, **kwargs):   # runs after the round's intra-node allreduce
            if state["round"] == at_round and not state.get("done"):   # once: a launcher may SIGCONT us later
                state["done"] = True
                mark()
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            return candidate(*args, **kwargs)
        hsadmm.HSADMM._round = tracked_round
        admm.node_candidate = candidate_then_fault
    elif fault == "kill-in-flight":
        after_step = hsadmm.HSADMM.after_step

        def fault_then_step(self):   # before after_step, which may fold the round in
            if self.overlap.in_flight is not None and self.round + 1 == at_round:
                mark()
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            after_step(self)
        hsadmm.HSADMM.after_step = fault_then_step
    elif fault == "nan":
        batches = data.ShardedLoader.batches
        state = {"step": 0}

        def poisoned(self, start=0):
            for x, y in batches(self, start):
                if self.train and torch.is_grad_enabled():   # a training step's batch, not BatchNorm recalibration's
                    state["step"] += 1
                    if state["step"] == state["poison_at"]:
                        mark()
                        x = torch.full_like(x, float("nan"))
                yield x, y
        state["poison_at"] = int(os.environ["FAULT_STEP"])   # the step before round K, given by the test
        data.ShardedLoader.batches = poisoned


def uneven(out: str, cases: list) -> None:
    """Per-epoch consensus over shards of different lengths, for each (name, odd rank, node_sync) of ``cases`` in
    turn, one job: every rank must refuse round 1, naming the counts; each rank writes the error it caught to
    OUT/NAME/error.rank{R}.txt and goes on to the next case (the refusal is agreed: the ranks stay in step)."""
    from torch import nn

    import prunex_hvd as px
    topo = px.init()
    for name, odd_rank, node_sync in cases:
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.AdaptiveAvgPool2d(1),
                              nn.Flatten())
        opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model, sparsity="channel:0.5",
                                      local_steps=1000, rho1=0.01, rho2=0.01, node_sync=node_sync)
        batches = 5 + (topo.rank == odd_rank)
        try:   # with node_sync the odd rank's extra step meets its node's round, and is refused there
            for _ in range(batches):
                opt.zero_grad()
                model(torch.randn(4, 1, 8, 8)).pow(2).mean().backward()
                opt.step()
            opt.consensus()
        except RuntimeError as exc:
            with open(os.path.join(folder, f"error.rank{topo.rank}.txt"), "w") as f:
                f.write(f"[rank {topo.rank}] prunex_hvd error: {exc}")
        else:
            raise AssertionError(f"case {name}: rank {topo.rank} completed round {opt.rounds_done()}")
    worker_io.report(out, topo.rank, {"cases": [c[0] for c in cases]}, len(cases))


def main():
    argv = sys.argv[1:]
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", required=True, choices=("kill", "kill-in-flight", "stop", "nan", "uneven"))
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--round", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--uneven", default="", metavar="NAME:R[:node-sync],...", help="the cases of --fault uneven")
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if a.fault == "uneven":
        return uneven(a.out, [(name, int(rank), bool(sync)) for name, rank, *sync in
                              (case.split(":") for case in a.uneven.split(","))])
    if worker_io.launch_rank() == a.rank:
        inject(a.fault, a.round, a.out)
    from prunex_hvd.app import cli
    sys.exit(cli.main(train_args))


if __name__ == "__main__":
    worker_io.run(main, "fault")
