"""Checkpoints of a whole job, written so that nothing is lost.

Every rank holds state of its own (θ and the dual u differ per rank), so every rank writes its own file,
``ckpt/tag{T}.rank{R}.pt``, atomically (temp file, fsync, rename). Only when all ranks report success does
rank 0 publish ``checkpoint.json`` (again temp + rename) naming tag T. A job killed at any moment leaves the
previous manifest and its files intact; older tags are deleted only after the new manifest is in place.
"""
from __future__ import annotations

import glob
import json
import os
import tempfile
from typing import Any, Dict, Optional

import torch

MANIFEST = "checkpoint.json"
FORMAT = 1


def atomic_write_bytes(path: str, write) -> None:
    """Call ``write(fileobj)`` on a temp file beside ``path``, fsync it, then rename it over ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_bytes(path, lambda f: f.write((json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()))


def atomic_torch_save(path: str, obj: Any) -> None:
    atomic_write_bytes(path, lambda f: torch.save(obj, f))


def _rank_file(out_dir: str, tag: int, rank: int) -> str:
    return os.path.join(out_dir, "ckpt", f"tag{tag:08d}.rank{rank:05d}.pt")


def save(out_dir: str, tag: int, state: Dict[str, Any], meta: Dict[str, Any], rank: int, control) -> None:
    """Collective: every rank writes its ``state``; rank 0 then publishes the manifest with ``meta`` (what a
    resume must match: model, topology, spec ...). Raises on every rank if any rank failed to write."""
    path = _rank_file(out_dir, tag, rank)
    error = None
    try:
        atomic_torch_save(path, {"format": FORMAT, "tag": tag, "rank": rank, "meta": meta, "state": state})
    except Exception as exc:  # reported collectively: no rank waits for a manifest that cannot be complete
        error = f"could not write checkpoint {path}: {exc}"
    control.agree(error, RuntimeError)
    if rank == 0:
        atomic_write_json(os.path.join(out_dir, MANIFEST),
                          {"format": FORMAT, "tag": tag, "world_size": control.size, "meta": meta})
    control.agree(None)  # the manifest is published before anyone deletes the old tag
    for old in glob.glob(os.path.join(out_dir, "ckpt", f"tag*.rank{rank:05d}.pt")):
        if old != path:
            os.unlink(old)


def load(out_dir: str, meta: Dict[str, Any], rank: int, control) -> Optional[Dict[str, Any]]:
    """Collective: read this rank's state of the published checkpoint, after checking on every rank that it
    fits this job (``meta`` and world size). Returns None on every rank when there is no checkpoint; raises
    ValueError on every rank if any rank finds it missing, corrupt or mismatched."""
    manifest_path = os.path.join(out_dir, MANIFEST)
    manifest, error = None, None
    if rank == 0 and os.path.exists(manifest_path):  # rank 0 publishes it, so rank 0 reads it for everyone
        try:
            with open(manifest_path) as f:
                manifest = json.load(f)
        except (OSError, ValueError) as exc:
            manifest = {"unreadable": f"{manifest_path}: {exc}"}
    manifest = control.broadcast_object(manifest, root=0)
    if manifest is None:
        return None
    state = None
    try:
        if "unreadable" in manifest:
            raise ValueError(f"the manifest {manifest['unreadable']}")
        if manifest.get("format") != FORMAT:
            raise ValueError(f"unknown checkpoint format {manifest.get('format')!r}")
        if manifest["world_size"] != control.size:
            raise ValueError(f"it was written by {manifest['world_size']} ranks, this job has {control.size}")
        diffs = {k: (manifest["meta"].get(k), v) for k, v in meta.items() if manifest["meta"].get(k) != v}
        if diffs:
            raise ValueError("it belongs to another job: " + ", ".join(
                f"{k} was {old!r}, now {new!r}" for k, (old, new) in sorted(diffs.items())))
        path = _rank_file(out_dir, manifest["tag"], rank)
        try:
            blob = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:
            raise ValueError(f"{path} is missing or unreadable ({type(exc).__name__}: {exc})") from None
        if not isinstance(blob, dict) or blob.get("tag") != manifest["tag"] or blob.get("rank") != rank:
            raise ValueError(f"{path} does not hold tag {manifest['tag']} of rank {rank}")
        state = blob["state"]
    except (ValueError, KeyError, TypeError) as exc:
        error = f"cannot resume from {out_dir}: {exc}"
    control.agree(error, ValueError)
    return state
