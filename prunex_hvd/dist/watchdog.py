"""A rank that dies or stalls stops the whole job within a bounded time, named, instead of a hang.

Every collective (the transport's, the control plane's, a consensus round) runs inside :func:`waiting`. A
thread on every rank sends a heartbeat, a line of JSON, to a hub on rank 0 every ``interval``: how many
world-wide points it has reached (control-plane calls and consensus rounds, the same sequence on every rank)
and the last one's name. A rank whose connection closes without a goodbye has died; one whose heartbeat
stops is stopped or hung. A rank waiting in a collective stops the job when

* some rank died (rank 0: the hub went away) — within about one ``interval``, or
* the collective outlasted the timeout (``PRUNEX_TIMEOUT_S``, ``--timeout``; 0 turns the watchdog off).

It prints which ranks did not arrive and why, tells the hub (so every rank stops with the same news, each
printing it), and leaves with :data:`EXIT_CODE` through ``os._exit``: a thread blocked inside MPI or Gloo
cannot be unwound, and the launcher then tears the job down. The last checkpoint is untouched: resume.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import selectors
import socket
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Dict, List, Optional

from .net import reachable_address

ENV_TIMEOUT = "PRUNEX_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
EXIT_CODE = 75   # EX_TEMPFAIL: try again (resume from the last checkpoint)
_way_back = "resume from the last checkpoint (--resume)"   # what the stop message tells the user to do


def set_way_back(text: str) -> None:
    """What the stop message says comes next (elastic training under torchrun: the agent restarts the workers)."""
    global _way_back
    _way_back = text

_current: Optional["Watchdog"] = None
_collective_timeout: Optional[float] = None   # set_collective_timeout()


def timeout_s(value=None) -> float:
    """The timeout in seconds: ``value`` if given, else env ``PRUNEX_TIMEOUT_S``, else the default; 0 = off."""
    raw = value if value is not None else os.environ.get(ENV_TIMEOUT, "")
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return DEFAULT_TIMEOUT_S
    try:
        t = float(raw)
    except (TypeError, ValueError):
        t = float("nan")
    if not (math.isfinite(t) and t >= 0):
        raise ValueError(f"the watchdog timeout ({ENV_TIMEOUT} / --timeout) must be a number of seconds >= 0 "
                         f"(0: off), got {raw!r}")
    return t


def default_timeout() -> timedelta:
    """How long a torch.distributed collective may wait for a peer before failing: past the watchdog's timeout
    (env ``PRUNEX_TIMEOUT_S``), so the watchdog, which names the missing rank, speaks first; 30 min without it."""
    if _collective_timeout is not None:
        return timedelta(seconds=_collective_timeout)
    wd = current()
    seconds = timeout_s(wd.timeout if wd else None)
    return timedelta(seconds=1.5 * seconds + 30 if seconds else 1800)


def set_collective_timeout(seconds: Optional[float]) -> None:
    """Elastic training runs no watchdog: a torch.distributed collective itself fails after ``seconds`` (a stalled
    peer is then a lost one). ``None``: :func:`default_timeout`'s rule again."""
    global _collective_timeout
    _collective_timeout = seconds or None


def current() -> Optional["Watchdog"]:
    return _current


@contextmanager
def waiting(label: str, world: bool = False, transport: bool = False):
    """A collective: armed against the timeout (outermost section only). ``world``: a point every rank passes
    in the same order (counted, so a rank behind the others is named). ``transport``: an error raised inside
    is, when a rank has died, replaced by the watchdog's stop naming it (a peer's death surfaces as an opaque
    connection error)."""
    wd = _current
    if wd is None:
        yield
        return
    wd.enter(label, world)
    try:
        yield
    except Exception:
        if transport:
            wd.stop_if_rank_died()
        raise
    finally:
        wd.leave()


def _send(sock: socket.socket, obj) -> None:
    sock.sendall((json.dumps(obj) + "\n").encode())


class _Hub:
    """Rank 0's thread: every rank's last heartbeat, who died (connection closed without a goodbye), and the
    first stop reported, handed back with every heartbeat's answer."""

    def __init__(self, size: int):
        self.size = size
        self.server = socket.create_server(("", 0))
        self.port = self.server.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.server, selectors.EVENT_READ)
        now = time.monotonic()
        self.table: Dict[int, dict] = {r: {"arrived": 0, "where": "start-up", "seen": now, "status": "alive"}
                                       for r in range(size)}
        self.stop_report: Optional[dict] = None
        self.closing = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="prunex-watchdog-hub", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        buffers: Dict[socket.socket, bytes] = {}
        ranks: Dict[socket.socket, int] = {}
        while not self.closing:
            for key, _ in self.sel.select(timeout=0.2):
                if key.fileobj is self.server:
                    conn, _ = self.server.accept()
                    self.sel.register(conn, selectors.EVENT_READ)
                    buffers[conn] = b""
                    continue
                conn = key.fileobj
                try:
                    data = conn.recv(65536)
                except OSError:
                    data = b""
                if not data:   # closed: a death unless the rank said goodbye
                    self.sel.unregister(conn)
                    conn.close()
                    r = ranks.pop(conn, None)
                    with self.lock:
                        if r is not None and self.table[r]["status"] == "alive":
                            self.table[r].update(status="dead", seen=time.monotonic())
                    continue
                buffers[conn] += data
                while b"\n" in buffers[conn]:
                    line, buffers[conn] = buffers[conn].split(b"\n", 1)
                    msg = json.loads(line)
                    ranks[conn] = msg["rank"]
                    try:
                        _send(conn, self._answer(msg))
                    except OSError:
                        pass
        for key in list(self.sel.get_map().values()):   # a clean exit of rank 0: nobody is to blame
            if key.fileobj is not self.server:
                try:
                    _send(key.fileobj, {"closing": True})
                except OSError:
                    pass
                key.fileobj.close()
        self.server.close()

    def _answer(self, msg: dict) -> dict:
        now = time.monotonic()
        with self.lock:
            entry = self.table[msg["rank"]]
            if msg["op"] == "bye":
                entry["status"] = "exited"
            elif entry["status"] == "alive":
                entry.update(arrived=msg["arrived"], where=msg["where"], seen=now)
            if msg["op"] == "stop":   # it leaves next: not a death to report
                entry["status"] = "stopped"
                if self.stop_report is None:
                    self.stop_report = {"rank": msg["rank"], "why": msg["why"]}
            out = {"seq": msg.get("seq"), "stop": self.stop_report,
                   "dead": [r for r, e in self.table.items() if e["status"] == "dead"]}
            if msg["op"] == "query":
                out["table"] = {r: dict(e, age=now - e["seen"]) for r, e in self.table.items()}
            return out

    def close(self) -> None:
        self.closing = True
        self.thread.join(timeout=2)


class Watchdog:
    """This rank's side: sections (:meth:`enter` / :meth:`leave`, cheap: attribute writes only) and the
    heartbeat thread that checks them."""

    def __init__(self, rank: int, size: int, timeout: float, address: tuple, hub: Optional[_Hub] = None):
        self.rank, self.size, self.timeout, self.hub = rank, size, timeout, hub
        self.interval = min(2.0, max(0.2, timeout / 10))
        self.arrived, self.where = 0, "start-up"
        self.depth, self.deadline, self.section = 0, None, ""
        self.hub_gone: Optional[str] = None   # why rank 0's hub cannot be heard, once it cannot
        self.hub_silent = False               # its last answer did not come in time (rank 0 stopped or hung)
        self._seq = 0
        self._buf = b""
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._fired = False
        self._fire_lock = threading.Lock()
        self.answer_timeout = max(1.0, 2 * self.interval)   # how long a heartbeat waits for the hub's answer
        self.sock = socket.create_connection(address, timeout=5)
        self.sock.settimeout(self.answer_timeout)
        self.thread = threading.Thread(target=self._loop, name="prunex-watchdog", daemon=True)
        self.thread.start()

    # -- the training thread's side ---------------------------------------------------------------------
    def enter(self, label: str, world: bool) -> None:
        if world:
            self.arrived += 1
            self.where = label
        if self.depth == 0:
            self.section = label
            self.deadline = time.monotonic() + self.timeout
        self.depth += 1

    def leave(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.deadline = None

    def stop_if_rank_died(self) -> None:
        """A collective raised: if a rank died (seen within a few heartbeats), stop naming it."""
        for _ in range(3):
            reply = self._ask("hb")
            dead = self._dead(reply)
            if dead:
                self._fire(f"{self.section} failed because rank {_ranks(dead)} died", reply)
            time.sleep(self.interval)

    # -- the heartbeat thread -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped.wait(self.interval):
            reply = self._ask("hb")
            if reply and reply.get("stop") and reply["stop"]["rank"] != self.rank:
                s = reply["stop"]
                self._fire(f"stopping with rank {s['rank']}, which reports: {s['why']}", None, relayed=True)
            deadline = self.deadline
            if deadline is None:
                continue
            dead = self._dead(reply)
            if dead:
                self._fire(f"{self.section} cannot complete", reply)
            elif time.monotonic() > deadline:
                self._fire(f"{self.section} did not complete within {self.timeout:g} s", reply)

    def _dead(self, reply: Optional[dict]) -> List[int]:
        if self.hub_gone:
            return [0]
        return list(reply.get("dead", [])) if reply else []

    def _ask(self, op: str, **extra) -> Optional[dict]:
        """Send a message to the hub and wait for its answer; None when the hub cannot be heard (recorded in
        ``hub_gone`` when it closed without saying so)."""
        if self.hub_gone:
            return None
        with self._lock:
            self._seq += 1
            seq = self._seq
            try:
                _send(self.sock, {"op": op, "rank": self.rank, "arrived": self.arrived, "where": self.where,
                                  "seq": seq, **extra})
                while True:
                    while b"\n" not in self._buf:
                        data = self.sock.recv(65536)
                        if not data:
                            self.hub_gone = "rank 0 died (its watchdog hub closed without a goodbye)"
                            return None
                        self._buf += data
                    line, self._buf = self._buf.split(b"\n", 1)
                    reply = json.loads(line)
                    if reply.get("closing"):   # rank 0 shut down cleanly: nobody to blame, nothing to watch
                        self._stopped.set()
                        return None
                    if reply.get("seq") == seq:   # an older answer that came late is skipped
                        self.hub_silent = False
                        return reply
            except socket.timeout:
                self.hub_silent = True
                return None
            except OSError as exc:
                self.hub_gone = f"rank 0 cannot be reached ({exc})"
                return None

    def _fire(self, why: str, reply: Optional[dict], relayed: bool = False) -> None:
        """Print what happened and who is missing, tell the hub, and leave the process."""
        with self._fire_lock:
            if self._fired:
                return
            self._fired = True
        tell = False
        if not relayed:
            answer = None if self.hub_silent else self._ask("query")   # every rank's state, as the hub has it
            if answer is not None and answer.get("stop") and answer["stop"]["rank"] != self.rank:
                s = answer["stop"]   # another rank was first: say what it said
                why = f"stopping with rank {s['rank']}, which reports: {s['why']}"
            else:
                why = f"{why}; {self._missing(answer)}"
                tell = True
        sys.stderr.write(f"[rank {self.rank}] prunex_hvd watchdog: {why}. Exiting with code {EXIT_CODE}; "
                         f"{_way_back}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        said = time.monotonic()
        if tell:   # after saying it: a silent hub holds this for the answer timeout
            self._ask("stop", why=why)
        # Linger so every rank says so itself: a launcher like mpirun ends the whole job as soon as the first of
        # us exits, so a rank that left at once could silence the others.
        time.sleep(max(0.0, said + self._linger() - time.monotonic()))
        os._exit(EXIT_CODE)

    def _linger(self) -> float:
        """Seconds from saying why to leaving. The hub tells every rank of the stop at its next heartbeat: two
        intervals and a half. A silent hub (rank 0 stopped or hung) tells nobody: each rank times out on its
        own clock, which it reads once a heartbeat, and a heartbeat to a silent hub also waits out the answer
        timeout. Ranks with the same deadline whose heartbeats are out of phase can read it on either side
        of it, so one fires up to a heartbeat (``interval + answer_timeout``) after another: linger that too."""
        grace = 2 * self.interval + 0.5
        if self.hub_silent:
            grace += self.interval + self.answer_timeout
        return grace

    def _missing(self, answer: Optional[dict]) -> str:
        if answer is None or "table" not in answer:
            return self.hub_gone or "rank 0 does not answer (stopped or hung: its watchdog hub is silent)"
        stale = max(3 * self.interval, 1.0)
        said = []
        for r, e in sorted(((int(r), e) for r, e in answer["table"].items())):
            if r == self.rank:
                continue
            if e["status"] == "dead":
                said.append(f"rank {r} died (its process is gone), last heard after '{e['where']}'")
            elif e["status"] == "stopped":
                said.append(f"rank {r} stopped the job too")
            elif e["status"] == "exited":
                said.append(f"rank {r} exited, last heard after '{e['where']}'")
            elif e["age"] > stale:
                said.append(f"rank {r} is silent for {e['age']:.0f} s (stopped or hung), last heard after '{e['where']}'")
            elif e["arrived"] < self.arrived:
                said.append(f"rank {r} has not arrived (still after '{e['where']}')")
        if not said:
            return f"every rank reached '{self.where}' and is alive: the transport itself is stuck"
        return f"this rank is at '{self.where}'; " + "; ".join(said)

    def close(self) -> None:
        """A clean goodbye (so the hub does not report this rank as dead), then stop the thread."""
        self._stopped.set()
        if not self.hub_gone:
            try:
                with self._lock:
                    _send(self.sock, {"op": "bye", "rank": self.rank, "arrived": self.arrived, "where": self.where})
            except OSError:
                pass
        self.thread.join(timeout=2 * self.interval + 2)
        self.sock.close()
        if self.hub is not None:
            # wait for the others' goodbyes, briefly, so none reads a closed hub as rank 0's death
            end = time.monotonic() + min(5.0, self.timeout)
            while time.monotonic() < end and any(e["status"] == "alive" for r, e in self.hub.table.items() if r):
                time.sleep(0.05)
            self.hub.close()


def _host_addresses() -> List[str]:
    """This host's IPv4 addresses, one per interface, loopback last (Linux; elsewhere none)."""
    try:
        import fcntl
        import struct
    except ImportError:
        return []
    found = []
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:   # SIOCGIFADDR
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
                found.append(socket.inet_ntoa(raw[20:24]))
            except OSError:
                continue
    return sorted(found, key=lambda a: a.startswith("127."))


def _ranks(ranks: List[int]) -> str:
    return ",".join(map(str, ranks))


def start(control, rank: int, size: int, timeout: Optional[float] = None) -> Optional[Watchdog]:
    """Collective: check every rank has the same timeout, then rank 0 opens the hub and every rank connects.
    Does nothing for one rank or timeout 0."""
    global _current
    stop()
    seconds, error = None, None
    try:
        seconds = timeout_s(timeout)
    except ValueError as exc:
        error = str(exc)
    control.agree(error, ValueError)
    values = control.allgather_object(seconds)
    if len(set(values)) > 1:
        raise ValueError("ranks disagree about the watchdog timeout: " + "; ".join(
            f"{v:g} s on ranks {_ranks([r for r, x in enumerate(values) if x == v])}" for v in sorted(set(values))))
    if size < 2 or seconds == 0:
        return None
    hub = _Hub(size) if rank == 0 else None
    hosts, port = control.broadcast_object(
        (list(dict.fromkeys([reachable_address()] + _host_addresses())), hub.port) if hub else None, root=0)
    wd, tried = None, []
    for host in hosts:   # the first of rank 0's addresses this rank can reach (hosts may be namespaces apart)
        try:
            wd = Watchdog(rank, size, seconds, (host, port), hub)
            break
        except OSError as exc:
            tried.append(f"{host}: {exc}")
    if wd is None:
        error = (f"cannot reach rank 0's watchdog on port {port} ({'; '.join(tried)}); set PRUNEX_MASTER_ADDR to "
                 f"an address of rank 0's host that every rank can reach, or {ENV_TIMEOUT}=0 to go without")
    try:
        control.agree(error, RuntimeError)
    except RuntimeError:
        if wd is not None:
            wd.close()
        elif hub is not None:
            hub.close()
        raise
    _current = wd
    return wd


def stop() -> None:
    global _current
    wd, _current = _current, None
    if wd is not None:
        wd.close()


atexit.register(stop)
