"""Elastic training: lose a node and keep training, from memory; a node that comes back (or a new one) joins at the
next round. Built on Horovod Elastic (``horovodrun --host-discovery-script``, its state objects and notifications).

    state = px.elastic.State(model, opt, epoch=0, batch=0)

    @px.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, (x, y) in enumerate(batches(state.epoch, start=state.batch), state.batch):
                ...; opt.step()
                if opt.rounds_done() > state.rounds: state.rounds = opt.rounds_done(); state.commit()
            state.batch = 0

    train(state)

launched as ``horovodrun -np 8 --min-np 4 --max-np 8 --host-discovery-script ./hosts.sh python train.py``, or on
every node as ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:4 --max-restarts 100 --rdzv-backend c10d
...  train.py``.

What happens (docs/reliability.md, "Elastic training"; the math in docs/algorithm.md, "Nodes lost and joined"):

1. ``state.commit()`` copies this rank's model, optimizer and engine state and the values given to :class:`State`
   into memory (every round, say), and raises Horovod's ``HostsUpdatedInterrupt`` if hosts were added.
2. A rank of another node dies, or stalls past the timeout: a collective fails on the survivors (Horovod's
   ``HorovodInternalError`` or torch.distributed's ``DistBackendError``). Each survivor goes back to its last
   commit. Horovod drops the failed host whole (all its ranks); a rank that cannot reach the launcher (its host
   cut off by a stalled link) leaves the job, so that Horovod drops its host too.
3. Horovod forms the new world; :meth:`State.sync` finds the nodes again, builds the groups over them and goes on:
   a survivor keeps its own state (θ, u, its node's z_i and v_i, z, ρ, the masks, the round); the lost node's
   duals left with it, and the next round's consensus is the mean over the nodes that remain. A joining rank takes
   z (on its support), the masks, ρ, the round, the step count and the values from the lowest surviving rank,
   with zero duals and zero momentum.
4. The decorated function is called again: its loop goes on from the values as committed.

Under torchrun its agent restarts every worker on a change of nodes, so a commit also goes to the node's shared
memory (:mod:`.dist.node_commits`) and the new worker takes it up before step 3; the function is called once per
worker. A node behind the newest round (one cut off that comes back) joins afresh.

Outside an elastic launch (``mpirun``, a plain ``horovodrun``) :func:`run` calls the function once:
MPI has no fault tolerance, so a lost rank ends the job as it always does (named by the watchdog), and
``--resume`` from the last checkpoint is the way back.
"""
from __future__ import annotations

import concurrent.futures
import copy
import functools
import os
import queue
import socket
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from .dist import launch, runtime, watchdog
from .dist.node_commits import NodeCommits
from .optimizer import say

__all__ = ["State", "run", "join_rendezvous"]


def _hvd():
    import horovod.torch as hvd
    return hvd


def _lost_errors() -> tuple:
    """The exceptions that mean a peer is gone: Horovod's and torch.distributed's."""
    errors: List[type] = []
    try:
        from horovod.common.exceptions import HorovodInternalError
        errors.append(HorovodInternalError)
    except ImportError:
        pass
    import torch.distributed as dist
    if hasattr(dist, "DistBackendError"):
        errors.append(dist.DistBackendError)
    return tuple(errors)


def _is_peer_failure(exc: BaseException) -> bool:
    """A torch.distributed Gloo error about a peer (older torch raises them as plain ``RuntimeError``)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Timed out waiting", "Broken pipe",
        "Socket Timeout", "Connection refused"))


class State:
    """What a rank keeps across a change of nodes: the ``model``, the wrapped ``optimizer`` (engine included) and
    the values given as keywords (counters such as ``epoch`` and ``batch``, or objects with ``state_dict()`` such
    as an lr scheduler), attributes of the state.

    ``commit()`` copies them into memory; a lost node sends every survivor back to its last commit. Commit once a
    round (a round's work is what a loss costs at most): ``opt.rounds_done()`` says when one has passed.
    ``register_reset_callbacks([fn])``: ``fn()`` runs after every change of nodes, before the state is synced (to
    re-shard data by ``hvd.size()`` / ``hvd.rank()``). ``changes`` lists every change seen, as dicts. Fewer nodes
    than ``min_nodes`` left stops the job with a ``ValueError`` on every rank."""

    def __init__(self, model: torch.nn.Module, optimizer, min_nodes: int = 1, **values: Any):
        if not hasattr(optimizer, "_elastic_form"):
            raise ValueError("prunex_hvd.elastic.State takes the optimizer prunex_hvd.DistributedOptimizer returned "
                             f"(PruneX), got {type(optimizer).__name__}")
        if not isinstance(min_nodes, int) or isinstance(min_nodes, bool) or min_nodes < 1:
            raise ValueError(f"min_nodes must be an integer >= 1, got {min_nodes!r}")
        join_rendezvous()
        self.model, self.optimizer, self.min_nodes = model, optimizer, min_nodes
        self._names = list(values)
        for name, value in values.items():
            setattr(self, name, value)
        self._saved: Optional[dict] = None
        self._previous: Optional[dict] = None   # the commit before: a rank whose last commit is a round ahead
        self._reset_callbacks: List[Callable[[], None]] = []
        self._host_messages: queue.Queue = queue.Queue()   # Horovod's notifications of hosts added or removed
        self._last_updated_timestamp = 0
        self.changes: List[Dict[str, Any]] = []
        self._lost_at: Optional[float] = None   # when this rank last saw a collective fail
        # torchrun restarts every worker on a change of nodes: commits go to the node's shared memory too
        self._node_commits = NodeCommits() if _under_torchrun() else None

    # -- Horovod's State protocol (horovod.common.elastic.State) ------------------------------------------
    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = queue.Queue()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res) -> None:
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Copy the state into memory, then check whether hosts were added (Horovod's ``HostsUpdatedInterrupt``:
        the decorated function is left and entered again over the new nodes). Collective under elastic."""
        self.save()
        if runtime.elastic_launch():
            self.check_host_updates()

    def check_host_updates(self) -> None:
        from horovod.common.exceptions import HostsUpdatedInterrupt
        from horovod.runner.elastic.worker import HostUpdateResult
        last = prev = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp > last:
                last, update = timestamp, update | result
        control = runtime.state()[1]
        prev, self._last_updated_timestamp, update = control.broadcast_object((prev, last, update))
        if self._last_updated_timestamp > prev:
            raise HostsUpdatedInterrupt(update == HostUpdateResult.removed)

    def save(self) -> None:
        """This rank's model, optimizer (and engine) and values, copied in memory (under torchrun also to the
        node's shared memory, for the worker its agent starts next); no communication."""
        self._previous = self._saved
        self._saved = {"model": copy.deepcopy(self.model.state_dict()),
                       "optimizer": self.optimizer._elastic_snapshot(),
                       "values": {n: self._value(n) for n in self._names}}
        if self._node_commits is not None:
            self._node_commits.write(self.optimizer.rounds_done(), self._saved)

    def reload(self) -> None:
        """torchrun: take up the commits this rank's predecessor on the node left (its agent restarted the
        workers); a worker with none (a node new to the job) keeps what it has. No communication."""
        self._saved, self._previous = self._node_commits.read()
        self.restore()

    def restore(self, previous: bool = False) -> None:
        """Back to the last :meth:`save` (``previous``: the one before it); no communication. A rank that never
        saved keeps what it has."""
        if previous:
            self._saved, self._previous = self._previous, None
        if self._saved is None:
            return
        saved = self._saved
        self.model.load_state_dict(saved["model"])
        self.optimizer._elastic_restore(saved["optimizer"])
        for name, value in saved["values"].items():
            self._set_value(name, copy.deepcopy(value))

    def sync(self) -> dict:
        """Collective over the processes Horovod has now: form the nodes and their groups, go on from memory
        where a rank has a state, hand the job's state to the ranks that join, then :meth:`save`. Returns (and
        appends to :attr:`changes`) what changed."""
        # under torchrun the agent formed the world when it started this worker
        topo = runtime.topology() if self._node_commits is not None else runtime.form(self.optimizer._config.backend)
        self.check_nodes(topo)
        control = runtime.state()[1]
        holds = self._saved is not None
        rows = control.allgather_object((holds, self.optimizer.rounds_done() if holds else None))
        rounds = sorted({r for h, r in rows if h})
        # a failure can strike between one rank's commit of a round and another's: the ranks a round ahead go
        # back to their commit before, so every holder is at the same round
        if len(rounds) == 2 and rounds[1] == rounds[0] + 1 and holds and self.optimizer.rounds_done() == rounds[1] \
                and self._previous is not None:
            self.restore(previous=True)
        holds = self._settle(topo, control, holds)
        opt = self.optimizer
        rows = control.allgather_object((holds, opt._step_count_local if holds else None,
                                         opt._config if holds else None))
        holders = [r for r, (h, _, _) in enumerate(rows) if h]
        root = holders[0] if holders else 0
        report = opt._elastic_form(holds, bool(holders), rows[root][1] or 0, rows[root][2])
        values = control.broadcast_object({n: self._value(n) for n in self._names}, root=root)
        if not holds and holders:   # a joining rank takes the job's values
            for name, value in values.items():
                self._set_value(name, value)
        change = {"nodes": topo.num_nodes, "ranks": topo.size, "round": self.optimizer.rounds_done(),
                  "joined": report.get("joined", []), "fresh": not holders,
                  "lost_s": None if self._lost_at is None else time.perf_counter() - self._lost_at}
        self.changes.append(change)
        restarted = self._node_commits is not None and bool(holders)   # torchrun's agent started these workers again
        if topo.rank == 0 and (holders and (report.get("joined") or self.changes[:-1] or restarted)):
            say(f"elastic: going on over {topo.num_nodes} node(s), {topo.size} rank(s), at round {change['round']}"
                + (" from the nodes' commits" if restarted else "")
                + (f"; rank(s) {','.join(map(str, report['joined']))} joined" if report.get("joined") else ""))
        self._lost_at = None
        self.save()
        return change

    def _settle(self, topo, control, holds: bool) -> bool:
        """Collective: whether this rank goes on from its state (:func:`nodes_going_on`); a rank that does not
        drops it and joins."""
        rows = control.allgather_object((topo.node, self.optimizer.rounds_done() if holds else None))
        keeps = topo.node in nodes_going_on(rows)
        if holds and not keeps:
            self._saved = self._previous = None
        return keeps

    def reset(self) -> None:
        pass

    def check_nodes(self, topo) -> None:
        """Refuse to go on over fewer than ``min_nodes`` nodes (the same answer on every rank: every rank has the
        same topology)."""
        if topo.num_nodes < self.min_nodes:
            raise ValueError(f"elastic: {topo.num_nodes} node(s) left ({topo.size} rank(s)), fewer than "
                             f"min_nodes={self.min_nodes}: the job stops here; bring nodes back and resume from the "
                             "last checkpoint")

    # -- the values -------------------------------------------------------------------------------------------
    def _value(self, name: str) -> Any:
        value = getattr(self, name)
        return copy.deepcopy(value.state_dict() if hasattr(value, "state_dict") else value)

    def _set_value(self, name: str, value: Any) -> None:
        current = getattr(self, name)
        if hasattr(current, "load_state_dict"):
            current.load_state_dict(value)
        else:
            setattr(self, name, value)


def nodes_going_on(rows: List[tuple]) -> set:
    """The nodes that go on from their state, from every rank's (node, round of its state or None) row: those
    whose every rank holds a state at the newest such round. A node behind it (under torchrun, one cut off that
    comes back with its old commits) or whose ranks differ joins afresh, whole: a node's ranks share z_i and v_i.
    Refused if ranks hold a state but no node qualifies."""
    by_node: Dict[int, set] = {}
    for node, round_ in rows:
        by_node.setdefault(node, set()).add(round_)
    whole = {n: next(iter(r)) for n, r in by_node.items() if len(r) == 1 and None not in r}
    if not whole:
        if any(r is not None for _, r in rows):
            raise ValueError("elastic: no node has every rank's state at one round (the ranks that trained share "
                             "their nodes with ranks that did not): resume from the last checkpoint")
        return set()
    newest = max(whole.values())
    return {n for n, r in whole.items() if r == newest}


def _under_torchrun() -> bool:
    return launch.detect() == "torchrun"


def join_rendezvous() -> None:
    """Under horovodrun's elastic mode, enter Horovod's rendezvous now (the nodes are formed later, in
    :meth:`State.sync`). A joining process should do it first: the ranks already training wait for it there."""
    if runtime.elastic_launch() and not _hvd().is_initialized():
        _hvd().init()


def _reset(state: "State") -> None:
    """Our groups down first, so that a peer still waiting on this rank in one of them fails at once rather than
    at the timeout; then Horovod down and up again (its rendezvous forms the new world). A rank that cannot reach
    the launcher's rendezvous leaves the job (:func:`_reach_launcher`, tried while Horovod shuts down: on a host
    cut off that shutdown waits for Horovod's own timeout)."""
    timeout = watchdog.default_timeout().total_seconds()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reached = pool.submit(_reach_launcher, timeout)
        state.optimizer._elastic_release()
        runtime.release()
        hvd = _hvd()
        hvd.shutdown()
        reached.result()
    hvd.init()


def _reach_launcher(timeout: float) -> None:
    """Return once the launcher's rendezvous server answers a TCP connect; raise if it has not for ``timeout``
    seconds. After a stall both sides of the cut see the same failed collective; what tells them apart is that
    the survivors still reach the launcher. A host cut off must leave: Horovod's rendezvous waits for every rank
    it knows of, so the survivors would wait for the link to come back. Its exit lets the launcher drop the host
    and the others go on; once the link is back, the host rejoins as a new one."""
    addr = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    port = int(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", 0) or 0)
    if not addr or not port:
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.5, min(5.0, deadline - time.monotonic()))).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                host = os.environ.get("HOROVOD_HOSTNAME", socket.gethostname())
                raise RuntimeError(f"elastic: host {host} cannot reach the launcher's rendezvous at {addr}:{port} for "
                                   f"{timeout:g} s ({exc}): it is cut off and this rank leaves the job; the others "
                                   "go on without it, and the host can join again once its link is back") from exc
            time.sleep(0.5)


RDZV_STORE_SHARING = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _run_under_torchrun(state: "State", func: Callable, *args, **kwargs):
    """torchrun's elastic agent restarts every worker on a change of nodes: a worker goes on from the commits its
    node's previous worker left in shared memory (:meth:`State.reload`), forms the nodes with the others
    (:meth:`State.sync`) and calls ``func`` once. A lost peer ends this worker (the watchdog, or the failed
    collective), and the agent starts the next one."""
    if not runtime.is_initialized():
        runtime.init(state.optimizer._config.backend)
    control = runtime.state()[1]
    control.agree(None if os.environ.get(RDZV_STORE_SHARING) == "1" else
                  f"elastic under torchrun needs {RDZV_STORE_SHARING}=1 in the launch's environment: with the "
                  "rendezvous store shared with the workers (torch's default), a node that joins a running job "
                  "waits for an address nobody writes until the rendezvous times out", ValueError)
    watchdog.set_way_back("torchrun's agent starts the workers again; they go on from this node's last commit")
    state.reload()
    state.sync()
    result = func(state, *args, **kwargs)
    state._node_commits.clear()
    return result


def run(func: Callable) -> Callable:
    """Decorate the training function ``func(state, ...)``: under horovodrun's elastic mode it is called again
    over the nodes left (or grown) whenever they change, from the state as last committed; under torchrun each
    worker its agent (re)starts calls it once, from its node's last commit; elsewhere it is called once
    (fail-fast: a lost rank ends the job)."""
    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if not isinstance(state, State):
            raise ValueError(f"@prunex_hvd.elastic.run: the first argument must be a prunex_hvd.elastic.State, "
                             f"got {type(state).__name__}")
        if state._node_commits is not None:
            return _run_under_torchrun(state, func, *args, **kwargs)
        if not runtime.elastic_launch():
            if runtime.launcher_rank() == 0:
                say("elastic: not under horovodrun's elastic mode (--host-discovery-script): a lost rank ends the "
                    "job; relaunch with --resume")
            if not runtime.is_initialized():
                runtime.init(state.optimizer._config.backend)
            state.check_nodes(runtime.topology())
            if state.optimizer._hsadmm is None:
                state.optimizer._elastic_form(False, False, 0)
            topo = runtime.topology()
            state.changes.append({"nodes": topo.num_nodes, "ranks": topo.size, "round": state.optimizer.rounds_done(),
                                  "joined": [], "fresh": True, "lost_s": None})
            state.save()
            return func(state, *args, **kwargs)
        from horovod.common.elastic import notification_manager
        from horovod.common.exceptions import HostsUpdatedInterrupt
        lost = _lost_errors()
        notification_manager.init()
        notification_manager.register_listener(state)
        try:
            while True:
                try:
                    state.sync()
                    return func(state, *args, **kwargs)
                except lost:
                    state._lost_at = time.perf_counter()
                    state.restore()
                except HostsUpdatedInterrupt:
                    pass
                except RuntimeError as exc:
                    if not _is_peer_failure(exc):
                        raise
                    state._lost_at = time.perf_counter()
                    state.restore()
                _reset(state)
                state.on_reset()
        finally:
            notification_manager.remove_listener(state)
    return wrapper
