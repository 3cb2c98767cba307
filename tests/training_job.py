"""The small `prunex-hvd train` job the launch tests share: 4 ranks as 2 nodes × 2 under mpirun, resnet_small on
8×8 digits, a round every 7 steps, 3 epochs of 22 steps.

The runs that end normally (or are refused) run as cases of one shared launch, ``train-2x2``
(tests/shared_launches.py, tests/workers/cli_worker.py): the uninterrupted run, slices and their resumes, the
refusals of a checkpoint from another job. The runs a fault ends get launches of their own (:func:`train`)."""
import json
from pathlib import Path

import torch

from launching import BIN, mpirun, run
from shared_launches import register

ARGS = ["--model", "resnet_small", "--dataset", "digits", "--image-size", "8", "--epochs", "3", "--local-steps", "7",
        "--batch-size", "16", "--lr", "0.05", "--rho1", "0.01", "--rho2", "0.001", "--freeze-round", "3",
        "--threads", "1"]
STEPS = 3 * (1437 // 4 // 16)                       # 22 batches per epoch and rank on the digits split
NODES2 = ["PRUNEX_RANKS_PER_NODE=2"]
GROUP = "train-2x2"
VIT = ["--model", "vit_tiny", "--sparsity", "head:0.5+neuron:0.5", "--coupled", "--epochs", "2",
       "--config", str(Path(__file__).parent / "launch" / "augment_none.json")]   # a setting without a flag
OVERLAP = ["--overlap", "7", "--freeze-round", "3"]


def case(name, *extra, exit=0, copy=None, drop=None):
    """Register the case NAME of the shared launch: ``prunex-hvd train ARGS EXTRA`` into the case's run folder,
    ending with status ``exit``; ``copy``: on a copy of that case's run (without its ``drop``)."""
    opts = ["--exit", str(exit)] + (["--copy", copy] if copy else []) + (["--drop", drop] if drop else [])
    return register(GROUP, name, "cli_worker", *opts, "--", "train", *ARGS, "--out", "{run}", *extra)


FULL = case("full")
SLICED = case("sliced", "--stop-after-rounds", "4")      # stops mid-epoch (step 28 of 22-step epochs)
RESUMED = case("resumed", "--resume", copy=SLICED)
VIT_REF = case("vit", *VIT, "--checkpoint-every", "0")
VIT_SLICED = case("vit-sliced", *VIT, "--stop-after-rounds", "4")
VIT_RESUMED = case("vit-resumed", *VIT, "--resume", copy=VIT_SLICED)
OVERLAP_REF = case("overlap", *OVERLAP, "--checkpoint-every", "0")
OVERLAP_SLICED = case("overlap-sliced", *OVERLAP, "--checkpoint-every", "1", "--stop-after-rounds", "4")
OVERLAP_RESUMED = case("overlap-resumed", *OVERLAP, "--checkpoint-every", "1", "--resume", copy=OVERLAP_SLICED)
ANOTHER = case("another", "--stop-after-rounds", "1")
ANOTHER_SPARSITY = case("another-sparsity", "--resume", "--sparsity", "channel:0.25", exit=2, copy=ANOTHER)
ANOTHER_SETTING = case("another-setting", "--resume", "--freeze-round", "2", "--threads", "2",
                       "--stop-after-rounds", "1", copy=ANOTHER)
ANOTHER_NEW_RUN = register(GROUP, "another-new-run", "cli_worker", "--exit", "2", "--", "train", *ARGS,
                           "--out", "{launch}/another/another")   # a new run over the original
ANOTHER_FILES_GONE = case("another-files-gone", "--resume", exit=2, copy=ANOTHER, drop="ckpt")
# the uninterrupted run again, from nothing but its folder's config.json (after FULL: cases run in this order)
AGAIN = register(GROUP, "again", "cli_worker", "--", "train", "--config", "{launch}/%s/%s/config.json" % (FULL, FULL),
                 "--out", "{run}")


def case_run(shared_launch, name):
    """The case NAME of the shared launch, checked to have ended as registered: (its run folder, what its ranks
    printed, rank after rank)."""
    from launching import worker_results
    proc, out = shared_launch(GROUP)
    worker_results(proc, out, "cli", case=name)
    printed = "".join((out / name / f"output.rank{r}.txt").read_text() for r in range(4))
    return out / name / name, printed


def train(out, *extra, np_=4, env_vars=(), cmd=None, timeout=300):
    """Run the job into ``out`` in a launch of its own; ``cmd`` replaces the `prunex-hvd` executable (a
    fault-injecting worker)."""
    cmd = cmd or [str(BIN / "prunex-hvd")]
    return run(mpirun(np_, [*cmd, "train", *ARGS, "--out", str(out), *extra], NODES2 + list(env_vars)),
               timeout=timeout)


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(ref, out, skip_events=()):
    """``out`` ended bit for bit where ``ref`` did: the same final weights and the same metrics but wall time
    (lines of the ``skip_events`` left out of both)."""
    a = torch.load(ref / "final_model.pt")["state_dict"]
    b = torch.load(out / "final_model.pt")["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    drop = lambda rec: {k: v for k, v in rec.items() if k not in ("wall_s", "exchange_wait_s")}  # noqa: E731
    assert [drop(r) for r in metrics(ref) if r.get("event") not in skip_events] == \
        [drop(r) for r in metrics(out) if r.get("event") not in skip_events]
