"""Checkpoint files: atomic under a real kill -9 of the writer, and every damaged or foreign checkpoint refused
with a message that names the problem (the multi-rank refusal on every rank is in test_faults.py)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from prunex_hvd.app import checkpoint
from prunex_hvd.dist.launch import Control

META = {"model": "resnet_small", "sparsity": "channel:0.5", "world_size": 1, "num_nodes": 1, "ranks_per_node": 1}


def saved(tmp_path, tag=7, meta=META):
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": tag}
    checkpoint.save(str(tmp_path), tag, state, meta, 0, Control())
    return state, tmp_path / "ckpt" / f"tag{tag:08d}.rank00000.pt"


def load(tmp_path, meta=META):
    return checkpoint.load(str(tmp_path), meta, 0, Control())


def test_round_trip_and_checksum_in_the_manifest(tmp_path):
    state, path = saved(tmp_path)
    manifest = json.loads((tmp_path / "checkpoint.json").read_text())
    import hashlib
    assert manifest["sha256"] == [hashlib.sha256(path.read_bytes()).hexdigest()]
    got = load(tmp_path)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 7
    assert load(tmp_path / "nothing-here") is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_a_damaged_rank_file_is_refused(tmp_path, damage):
    _, path = saved(tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip":       # one byte inside the tensor data: torch.load alone would not notice
        raw[len(raw) // 2] ^= 0x01
    else:
        raw = b""
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"cannot resume from .*tag00000007\.rank00000\.pt is corrupt: its SHA-256 "
                                         r"differs .*truncated or altered"):
        load(tmp_path)


def test_without_a_recorded_checksum_a_truncated_file_is_still_refused(tmp_path):
    _, path = saved(tmp_path)
    manifest = json.loads((tmp_path / "checkpoint.json").read_text())
    del manifest["sha256"]                       # a manifest from before checksums
    (tmp_path / "checkpoint.json").write_text(json.dumps(manifest))
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(ValueError, match=r"rank00000\.pt is unreadable \("):
        load(tmp_path)


def test_missing_file_and_corrupt_manifest(tmp_path):
    _, path = saved(tmp_path)
    path.unlink()
    with pytest.raises(ValueError, match=r"rank00000\.pt is missing or unreadable \(FileNotFoundError"):
        load(tmp_path)
    (tmp_path / "checkpoint.json").write_text('{"format": 1, "tag": 7, "wor')   # cut short
    with pytest.raises(ValueError, match=r"cannot resume from .*: the manifest .*checkpoint\.json: "):
        load(tmp_path)
    (tmp_path / "checkpoint.json").write_text('{"format": 99}')
    with pytest.raises(ValueError, match=r"unknown checkpoint format 99"):
        load(tmp_path)


def test_a_file_of_another_tag_at_the_right_path_is_refused(tmp_path):
    saved(tmp_path, tag=5)
    old = (tmp_path / "ckpt" / "tag00000005.rank00000.pt").read_bytes()
    _, path = saved(tmp_path, tag=7)
    path.write_bytes(old)                        # a stale file copied over, checksum made to match
    manifest = json.loads((tmp_path / "checkpoint.json").read_text())
    import hashlib
    manifest["sha256"] = [hashlib.sha256(old).hexdigest()]
    (tmp_path / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"does not hold tag 7 of rank 0"):
        load(tmp_path)


@pytest.mark.parametrize("change,message", [
    ({"model": "resnet18"}, r"it belongs to another job: model was 'resnet_small', now 'resnet18'"),
    ({"sparsity": "filter:0.5"}, r"sparsity was 'channel:0.5', now 'filter:0.5'"),
    ({"num_nodes": 2, "ranks_per_node": 2}, r"num_nodes was 1, now 2, ranks_per_node was 1, now 2"),
])
def test_a_checkpoint_of_another_job_is_refused(tmp_path, change, message):
    saved(tmp_path)
    with pytest.raises(ValueError, match=message):
        load(tmp_path, dict(META, **change))


def test_another_world_size_is_refused(tmp_path):
    saved(tmp_path)
    manifest = json.loads((tmp_path / "checkpoint.json").read_text())
    manifest["world_size"] = 4
    (tmp_path / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"it was written by 4 ranks, this job has 1"):
        load(tmp_path)


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "f.bin"
    checkpoint.atomic_write_bytes(str(path), lambda f: f.write(b"old"))

    def half_then_fail(f):
        f.write(b"new but cut")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        checkpoint.atomic_write_bytes(str(path), half_then_fail)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]


WRITER = """
import sys, torch
from prunex_hvd.app import checkpoint
from prunex_hvd.dist.launch import Control
out = sys.argv[1]
big = torch.randn(6_000_000)            # 24 MB per checkpoint: a kill lands inside a write most of the time
for tag in range(1, 10_000):
    w = big + tag
    checkpoint.save(out, tag, {"w": w, "tag": tag, "sum": float(w.double().sum())}, {"m": 1}, 0, Control())
    print(tag, flush=True)
"""


def test_kill_9_while_writing_leaves_the_last_checkpoint_whole(tmp_path):
    """A real writer process, killed with SIGKILL at several moments: each time the published checkpoint
    loads, passes its checksum and holds exactly what was saved under its tag."""
    for delay in (0.05, 0.25, 0.6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip()          # one checkpoint is published
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        state = checkpoint.load(str(tmp_path), {"m": 1}, 0, Control())
        tag = state["tag"]
        assert tag >= 1 and json.loads((tmp_path / "checkpoint.json").read_text())["tag"] == tag
        assert state["w"].shape == (6_000_000,) and float(state["w"].double().sum()) == state["sum"]
    # the next save (a resumed job's first) sweeps the temp files the kills left behind
    checkpoint.save(str(tmp_path), 10_000, {"tag": 0}, {"m": 1}, 0, Control())
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["tag00010000.rank00000.pt"]
