"""Elastic training through the Python API (prunex_hvd.elastic), for tests/launch/test_elastic_launch.py.

    elastic_worker.py OUT ROUNDS STEP_SLEEP_S

Each process writes OUT/pids/HOST.PID when it starts (so the test can kill a host's ranks) and trains a small CNN on
its own synthetic batches, a round every 4 steps, committing after each round; rank 0 appends one line per round
to OUT/progress.jsonl (round, ranks, nodes, the time, whether the round was checked). The first round after every
change of nodes (the start included) is checked against the single-process reference of that round, over every
rank's state just before it: the survivors' as committed, a joiner's as handed to it. At the end every rank writes
OUT/final/rank{R}.json: its pid and host, the changes of nodes it saw, the rounds and the consensus model's
checksum."""
import json
import os
import socket
import sys
import time
import zlib

import torch
from torch import nn

import worker_io
import prunex_hvd as px
from prunex_hvd.dist import runtime

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import engine_cases as cases  # noqa: E402


def batch(host: str, local_rank: int, index: int):
    g = torch.Generator().manual_seed(zlib.crc32(f"{host}.{local_rank}.{index}".encode()))
    x = torch.randn(16, 3, 8, 8, generator=g)
    return x, (x[:, 0].mean((1, 2)) > 0).long() + 2 * (x[:, 1].mean((1, 2)) > 0).long()


def main():
    out, rounds, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    host = os.environ.get("HOROVOD_HOSTNAME") or os.environ.get("PX_TEST_HOST") or socket.gethostname()
    os.makedirs(os.path.join(out, "pids"), exist_ok=True)
    open(os.path.join(out, "pids", f"{host}.{os.getpid()}"), "w").close()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                  sparsity="channel:0.5", local_steps=4)
    state = px.elastic.State(model, opt, batch=0)
    check = {"pending": False, "done": False}
    consensus = opt.consensus

    def checked_consensus():
        """The round; the first after a change of nodes against the reference round over the states before it."""
        if not check["pending"]:
            return consensus()
        check["pending"] = False
        control, topo = runtime.state()[1], px.topology()
        before = control.allgather_object(cases.snapshot(opt._engine))
        report = consensus()
        after = control.allgather_object(cases.snapshot(opt._engine))
        if topo.rank == 0:
            cases.check_round(before[0]["round"], before, after, topo.node_ranks, opt._engine)
            check["done"] = True
        return report
    opt.consensus = checked_consensus

    @px.elastic.run
    def train(state):
        topo = px.topology()
        check["pending"] = True   # every rank: the nodes were (re)formed just now
        while opt.rounds_done() < rounds:
            x, y = batch(host, topo.local_rank, state.batch)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            before = opt.rounds_done()
            opt.step()
            state.batch += 1
            time.sleep(pause)
            if opt.rounds_done() > before:
                if topo.rank == 0:
                    with open(os.path.join(out, "progress.jsonl"), "a") as f:
                        f.write(json.dumps({"round": opt.rounds_done(), "ranks": topo.size, "nodes": topo.num_nodes,
                                            "time": time.time(), "checked": check["done"]}) + "\n")
                    check["done"] = False
                state.commit()   # (raises when hosts were added: the round is logged first)
        opt.finalize()
        return topo

    topo = train(state)
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    result = {"pid": os.getpid(), "host": host, "rank": topo.rank, "changes": state.changes,
              "rounds": opt.rounds_done(), "batch": state.batch, "checksum": float(final.double().sum()),
              "density": opt.stats()["density"]}
    os.makedirs(os.path.join(out, "final"), exist_ok=True)
    with open(os.path.join(out, "final", f"rank{topo.rank}.json"), "w") as f:
        json.dump(result, f)
    runtime.finish()
    print(f"[rank {topo.rank}] ok elastic host={host} pid={os.getpid()}", flush=True)


if __name__ == "__main__":
    worker_io.run(main, "elastic")
