"""Elastic commits that outlive a worker process, for torchrun.

On a change of nodes torchrun's agent stops every worker of its node and starts new ones over the new world. What a
rank committed (its model, duals, z_i, v_i, ...) must reach its successor without a disk: :class:`NodeCommits`
keeps this rank's last two commits in the node's shared memory (``/dev/shm``, RAM), one file per round, written
atomically (a worker stopped mid-write leaves the commit before whole). The directory is keyed by torchrun's run
id, the agent (the workers' parent process) and the local rank: a restarted worker finds its predecessor's commits,
a node whose agent is new (one that comes back) starts empty, and the directories of agents that are gone are
removed.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Optional, Tuple

import torch

SHM = "/dev/shm"
PREFIX = "prunex_hvd-commits-"


def _root() -> str:
    return SHM if os.path.isdir(SHM) else os.environ.get("TMPDIR", "/tmp")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class NodeCommits:
    """This rank's commits in the node's shared memory (``root``: ``/dev/shm`` where there is one)."""

    def __init__(self, root: Optional[str] = None):
        self.root = root or _root()
        self.run_id = re.sub(r"[^A-Za-z0-9_.-]", "_", os.environ.get("TORCHELASTIC_RUN_ID", "none"))
        self.agent = os.getppid()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.dir = os.path.join(self.root, f"{PREFIX}{self.run_id}-{self.agent}")
        self._forget_agents_gone()

    def _forget_agents_gone(self) -> None:
        mine = f"{PREFIX}{self.run_id}-"
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        for name in names:
            pid = name[len(mine):]
            if name.startswith(mine) and pid.isdigit() and int(pid) != self.agent and not _alive(int(pid)):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def _rounds(self) -> list:
        """The rounds this rank has a commit of, oldest first."""
        pattern = re.compile(rf"^rank{self.local_rank}\.round(\d+)\.pt$")
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(pattern.match, names) if m)

    def _path(self, round_: int) -> str:
        return os.path.join(self.dir, f"rank{self.local_rank}.round{round_}.pt")

    def write(self, round_: int, commit: dict) -> None:
        """Keep ``commit`` as this rank's commit of ``round_`` (over one of the same round), and the one before it."""
        os.makedirs(self.dir, exist_ok=True)
        tmp = os.path.join(self.dir, f".rank{self.local_rank}.tmp")
        try:
            torch.save(commit, tmp)
        except (OSError, RuntimeError) as exc:   # torch's writer reports a full disk as a RuntimeError
            raise RuntimeError(f"elastic: this rank's commit could not be written to {self.dir} ({exc}); a commit "
                               "takes about 6 times the model's size in shared memory: under Docker give the "
                               "container more (docker run --shm-size=...)") from exc
        os.replace(tmp, self._path(round_))
        for old in self._rounds()[:-2]:
            os.remove(self._path(old))

    def read(self) -> Tuple[Optional[dict], Optional[dict]]:
        """The newest commit and the one before it (None where there is none)."""
        rounds = self._rounds()
        loaded = [torch.load(self._path(r), weights_only=False) for r in rounds[-2:]]
        return (loaded[-1] if loaded else None), (loaded[-2] if len(loaded) > 1 else None)

    def clear(self) -> None:
        """Forget this rank's commits (the job ended); the directory goes with the last rank's."""
        for r in self._rounds():
            os.remove(self._path(r))
        try:
            os.rmdir(self.dir)
        except OSError:
            pass
