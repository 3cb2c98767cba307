"""Launches shared by the cases of many tests: a launch costs seconds of start-up on a small host (every rank
imports torch), and many checks need only a launcher and a layout, not a job of their own.

A test module registers its cases at import (``register(GROUP, NAME, WORKER, *ARGS)``); the session fixture
``shared_launch`` (tests/conftest.py) runs every case registered for GROUP in one job, on first use, through
tests/workers/sequence.py, and each test reads its own case's files (``worker_results(..., case=NAME)``). A case
that fails ends the job, so the tests of the cases after it fail with its message."""
from launching import horovodrun, mpirun, python_cmd, run

NODES2 = ["PRUNEX_RANKS_PER_NODE=2"]
RACK_ENV = ["PRUNEX_RANKS_PER_NODE=2", "PRUNEX_NODES_PER_RACK=2"]

# group: (its launcher around the command, the environment of the launch)
GROUPS = {
    "mpirun-2x2": (lambda cmd: mpirun(4, cmd, NODES2), None),                     # 4 ranks as 2 nodes × 2
    "train-2x2": (lambda cmd: mpirun(4, cmd, NODES2), None),                      # `prunex-hvd train` runs
    "mpirun-racks": (lambda cmd: mpirun(8, cmd, RACK_ENV), None),                 # 2 racks × 2 nodes × 2
    "horovodrun-2x2": (lambda cmd: horovodrun(4, "localhost:2,127.0.0.1:2", cmd), None),   # Horovod: 2 nodes × 2
    "horovodrun-racks": (lambda cmd: horovodrun(8, "localhost:4,127.0.0.1:4", cmd),
                         dict(e.split("=") for e in RACK_ENV)),
}
CASES = {group: {} for group in GROUPS}


def register(group: str, name: str, worker: str, *args: str) -> str:
    """Add the case NAME (``tests/workers/WORKER.py ARGS``) to GROUP's launch; returns NAME."""
    if name in CASES[group] and CASES[group][name] != (worker, list(args)):
        raise ValueError(f"{group}: case {name!r} registered twice with different arguments")
    CASES[group][name] = (worker, list(args))
    return name


def launch(group: str, out):
    """Run GROUP's cases in one job into OUT (each in OUT/NAME): (the finished job, OUT)."""
    import json
    wrap, env = GROUPS[group]
    cases = [[name, worker, args] for name, (worker, args) in CASES[group].items()]
    cmd = python_cmd("sequence.py", "--cases", json.dumps(cases), "--out", str(out))
    return run(wrap(cmd), env=env, timeout=300 + 60 * len(cases)), out
