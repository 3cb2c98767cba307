"""One `prunex-hvd` command run in this process, as a case of a shared launch (tests/workers/sequence.py): the
launch pays its ranks' start-up once for many training runs.

    python cli_worker.py --out CASE [--exit N] [--copy NAME [--drop PATH]] -- train ARGS...

In ARGS, ``{run}`` is CASE/NAME, NAME being CASE's name (where the command writes its run), and ``{launch}``
the launch's folder (CASE's parent: the other cases' folders). ``--copy NAME`` first copies case NAME's run into
{run} (rank 0; the others wait at an MPI barrier, so under mpirun), without its PATH if ``--drop PATH``: a case
resumes or refuses a copy, leaving the original for the tests. Each rank writes what the command printed (stdout and stderr) to CASE/output.rank{R}.txt;
the case fails unless the command exits with N (default 0). A run resumed here starts in a process that ran other
jobs before: the sequence reseeds the global random generators between cases, so a resume that left one
unrestored shows."""
import argparse
import contextlib
import os
import shutil
import sys

import worker_io


def copy_run(launch: str, source: str, to: str, drop: str | None) -> None:
    """Rank 0 copies case SOURCE's run to TO (without DROP); every rank returns once it is there."""
    from mpi4py import MPI
    if MPI.COMM_WORLD.rank == 0:
        shutil.copytree(os.path.join(launch, source, source), to)
        if drop:
            shutil.rmtree(os.path.join(to, drop))
    MPI.COMM_WORLD.Barrier()


def main():
    argv = sys.argv[1:]
    split = argv.index("--")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--exit", type=int, default=0, help="the exit status the command must end with")
    ap.add_argument("--copy", metavar="NAME", help="start from a copy of case NAME's run")
    ap.add_argument("--drop", metavar="PATH", help="with --copy: remove PATH from the copy")
    a = ap.parse_args(argv[:split])
    case = os.path.abspath(a.out)
    launch, run = os.path.dirname(case), os.path.join(case, os.path.basename(case))
    command = [arg.replace("{run}", run).replace("{launch}", launch) for arg in argv[split + 1:]]
    if a.copy:
        copy_run(launch, a.copy, run, a.drop)
    rank = worker_io.launch_rank(0)
    output = os.path.join(a.out, f"output.rank{rank}.txt")
    from prunex_hvd.app import cli
    with open(output, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        try:
            code = cli.main(command)
        except SystemExit as exc:   # argparse's own errors
            code = exc.code
    if code != a.exit:
        with open(output) as f:
            tail = f.read()[-3000:]
        raise AssertionError(f"prunex-hvd {' '.join(command)} exited {code}, not {a.exit}:\n{tail}")
    worker_io.report(a.out, rank, {"exit": code}, 1)


if __name__ == "__main__":
    worker_io.run(main, "cli")
