"""The small `prunex-hvd train` job the launch tests share: 4 ranks as 2 nodes × 2 under mpirun, resnet_small on
8×8 digits, a round every 7 steps, 3 epochs of 22 steps."""
import json

import torch

from launching import BIN, mpirun, run

ARGS = ["--model", "resnet_small", "--dataset", "digits", "--image-size", "8", "--epochs", "3", "--local-steps", "7",
        "--batch-size", "16", "--lr", "0.05", "--rho1", "0.01", "--rho2", "0.001", "--freeze-round", "3",
        "--threads", "1"]
STEPS = 3 * (1437 // 4 // 16)                       # 22 batches per epoch and rank on the digits split
NODES2 = ["PRUNEX_RANKS_PER_NODE=2"]


def train(out, *extra, np_=4, env_vars=(), cmd=None, timeout=300):
    """Run the job into ``out``; ``cmd`` replaces the `prunex-hvd` executable (a fault-injecting worker)."""
    cmd = cmd or [str(BIN / "prunex-hvd")]
    return run(mpirun(np_, [*cmd, "train", *ARGS, "--out", str(out), *extra], NODES2 + list(env_vars)),
               timeout=timeout)


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(ref, out):
    """``out`` ended bit for bit where ``ref`` did: the same final weights and the same metrics but wall time."""
    a = torch.load(ref / "final_model.pt")["state_dict"]
    b = torch.load(out / "final_model.pt")["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    drop = lambda rec: {k: v for k, v in rec.items() if k not in ("wall_s", "exchange_wait_s")}  # noqa: E731
    assert [drop(r) for r in metrics(ref)] == [drop(r) for r in metrics(out)]
