"""Several workers' cases one after the other in one launch: a launch costs seconds of start-up on a small host
(every rank imports torch), and many checks need the same launcher and layout, not a job of their own.

    mpirun -np 4 python sequence.py --out DIR --cases '[[NAME, WORKER, [ARGS...]], ...]'

Each case runs ``WORKER.main()`` (a module of this folder) with ``--out DIR/NAME ARGS``, its "ok" line naming the
case (``worker_io.CASE``). Between cases prunex_hvd is shut down and its ledger reset, so each case initializes
it as it would alone, and the global random generators are reseeded (:func:`reseed`). A failing case ends the
job: "[rank R] sequence worker error: case NAME: ..."."""
import argparse
import importlib
import json
import os
import sys
import time

import worker_io


def reseed(name: str) -> None:
    """Global random generators at a state of the case's own (not where the last case left them): a case that
    relies on them without seeding, or a resume that does not restore them, shows."""
    import random
    import zlib

    import numpy as np
    import torch
    seed = zlib.crc32(name.encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", required=True, metavar="JSON")
    a = ap.parse_args()
    import prunex_hvd as px
    for name, worker, args in json.loads(a.cases):
        folder = os.path.join(a.out, name)
        os.makedirs(folder, exist_ok=True)
        sys.argv = [f"{worker}.py", "--out", folder, *args]
        worker_io.CASE = name
        px.shutdown()
        px.comm.reset()
        reseed(name)
        start = time.perf_counter()
        try:
            importlib.import_module(worker).main()
        except Exception as exc:
            raise RuntimeError(f"case {name}: {type(exc).__name__}: {exc}") from exc
        # what each case costs, for whoever keeps the shared launches short
        print(f"[rank {worker_io.launch_rank('?')}] case {name} took {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    worker_io.run(main, "sequence")
