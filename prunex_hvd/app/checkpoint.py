"""Checkpoints of a whole job, written so that nothing is lost.

Every rank holds state of its own (θ and the dual u differ per rank), so every rank writes its own file,
``ckpt/tag{T}.rank{R}.pt``, atomically (temp file, fsync, rename). Only when all ranks report success does
rank 0 publish ``checkpoint.json`` (again temp + rename) naming tag T and the SHA-256 of every rank's file. A
job killed at any moment leaves the previous manifest and its files intact; older tags are deleted only after
the new manifest is in place. A resume refuses, on every rank, a file that is missing, truncated or altered
(checksum), and a checkpoint of another job (model, data, spec, method, topology).
"""
from __future__ import annotations

import glob
import hashlib
import io
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


class _Hashing:
    """A write-only file that hashes what passes through (the checksum costs no second read)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, b) -> int:
        self.sha.update(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def atomic_torch_save(path: str, obj: Any) -> str:
    """``torch.save`` atomically; returns the file's SHA-256 (hex)."""
    out = {}

    def write(f):
        h = _Hashing(f)
        torch.save(obj, h)
        out["sha256"] = h.sha.hexdigest()
    atomic_write_bytes(path, write)
    return out["sha256"]


def _rank_file(out_dir: str, tag: int, rank: int) -> str:
    return os.path.join(out_dir, "ckpt", f"tag{tag:08d}.rank{rank:05d}.pt")


def save(out_dir: str, tag: int, state: Dict[str, Any], meta: Dict[str, Any], rank: int, control) -> None:
    """Collective: every rank writes its ``state``; rank 0 then publishes the manifest with ``meta`` (what a
    resume must match: model, topology, spec ...). Raises on every rank if any rank failed to write."""
    path = _rank_file(out_dir, tag, rank)
    error, digest = None, None
    try:
        digest = atomic_torch_save(path, {"format": FORMAT, "tag": tag, "rank": rank, "meta": meta, "state": state})
    except Exception as exc:  # reported collectively: no rank waits for a manifest that cannot be complete
        error = f"could not write checkpoint {path}: {exc}"
    digests = control.allgather_object(digest)
    control.agree(error, RuntimeError)
    if rank == 0:
        atomic_write_json(os.path.join(out_dir, MANIFEST),
                          {"format": FORMAT, "tag": tag, "world_size": control.size, "meta": meta, "sha256": digests})
    control.agree(None)  # the manifest is published before anyone deletes the old tag
    stale = glob.glob(os.path.join(out_dir, "ckpt", f"tag*.rank{rank:05d}.pt"))
    stale += glob.glob(os.path.join(out_dir, "ckpt", f".tag*.rank{rank:05d}.pt.*.tmp"))   # left by a kill mid-write
    for old in stale:
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
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise ValueError(f"{path} is missing or unreadable ({type(exc).__name__}: {exc})") from None
        want = (manifest.get("sha256") or [None] * control.size)[rank]
        if want is not None and hashlib.sha256(raw).hexdigest() != want:
            raise ValueError(f"{path} is corrupt: its SHA-256 differs from the one recorded when it was written "
                             f"({len(raw)} bytes now; truncated or altered)")
        try:
            blob = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
        except Exception as exc:
            raise ValueError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from None
        if not isinstance(blob, dict) or blob.get("tag") != manifest["tag"] or blob.get("rank") != rank:
            raise ValueError(f"{path} does not hold tag {manifest['tag']} of rank {rank}")
        state = blob["state"]
    except (ValueError, KeyError, TypeError) as exc:
        error = f"cannot resume from {out_dir}: {exc}"
    control.agree(error, ValueError)
    return state
