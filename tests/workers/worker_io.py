"""What every launch-test worker shares: its per-rank result file, the error line the parent test greps, and a
tensor comparison that names what it compared."""
import json
import os
import sys
import time
import traceback

# the case of a launch that runs several (tests/workers/sequence.py sets it): named in the "ok" line
CASE = None


def launch_rank(default=None):
    """This process's rank as its launcher (horovodrun, mpirun, torchrun) set it, without initialising anything;
    ``default`` when none did."""
    for var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return default


def report(out: str, rank: int, result: dict, checks: int) -> None:
    """Write OUT/rank{R}.json and the "ok" line the parent counts (naming the :data:`CASE`, if any)."""
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    print(f"[rank {rank}] ok checks={checks}" + (f" case={CASE}" if CASE else ""), flush=True)


def run(main, name: str) -> None:
    """Run ``main``; on any failure print "[rank R] NAME worker error: ..." and exit 3 (after a pause, so
    the launcher forwards the line before it tears the job down)."""
    try:
        main()
    except Exception as exc:  # noqa: BLE001
        print(f"[rank {launch_rank('?')}] {name} worker error: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        time.sleep(2)
        sys.exit(3)


def assert_close(got, want, what: str, **tolerances) -> None:
    """``torch.testing.assert_close`` whose message starts with ``what`` (the step, rank and tensor compared)."""
    import torch
    torch.testing.assert_close(got, want, **tolerances, msg=lambda m: f"{what}: {m}")
