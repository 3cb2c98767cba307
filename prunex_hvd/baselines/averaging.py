"""The rivals that talk once per round, as PruneX does: local SGD, hierarchical local SGD and DiLoCo.

    from prunex_hvd.baselines import averaging
    opt = averaging.LocalSGD(optimizer, model, period=100)                      # --method localsgd
    opt = averaging.HierarchicalLocalSGD(optimizer, model, period=100, intra_period=25)   # localsgd-hier
    opt = averaging.DiLoCo(optimizer, model, period=100, outer_lr=0.7, outer_momentum=0.9)   # diloco

Each rank takes ``period`` steps of the user's optimizer on its own batches, then a round:

* **local SGD** (Lin et al. 2018, post-local SGD without the warm-up): the parameters averaged over the world
  by PyTorch's ``PeriodicModelAverager``.
* **hierarchical local SGD** (Lu et al. 2020): PyTorch's ``HierarchicalModelAverager`` averages within the
  node every ``intra_period`` steps (fast links) and over the world every ``period`` steps; ``intra_period``
  must divide ``period``. PyTorch forms the node groups from consecutive ranks, so nodes must be
  consecutive rank blocks (as mpirun, horovodrun and torchrun place them by default).
* **DiLoCo** (Douillard et al. 2023): the locals are averaged (PyTorch's ``average_parameters``), the
  pseudo-gradient Δ = θ_global − mean_r θ_r drives an outer ``torch.optim.SGD(nesterov=True)`` step on
  θ_global (paper defaults: lr 0.7, momentum 0.9), and every rank restarts from θ_global. ``torchft``'s
  DiLoCo needs its lighthouse server and a fault-tolerance manager per replica group, which our launchers do
  not run; the outer loop here is those few lines around PyTorch's optimizer.

In every round the float buffers (BatchNorm statistics) are averaged too, through the package's world group.
The parameters travel by ``torch.distributed`` on the groups the package builds (gloo on CPU, nccl on CUDA),
outside our communicators: each such allreduce is recorded in the ledger under the ring model, on the tier it
used (``intra`` for a node's group, ``world`` otherwise), so bytes compare with every other method.

The model to evaluate (:meth:`consensus_weights`) and the final model (:meth:`finalize`) are the last
round's: the averaged parameters (DiLoCo: θ_global) and buffers, the same on every rank.
"""
from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional

import torch
from torch.distributed.algorithms.model_averaging import averagers, utils
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager

from ..dist import agreement, runtime, watchdog
from ..dist.comm import groups as comm_groups
from ..dist.comm.accounting import record_ring
from .common import MethodOptimizer, average_buffers, broadcast_model, check_wrapping, mix_into


def _integer(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _started(averager):
    """PyTorch's averagers count steps from 0 and average at step 0 (then every period): started at 1, they
    average after our step ``period``, 2·``period``, ..., where PruneX's rounds fall."""
    averager.step = 1
    return averager


class _RoundAveraging(MethodOptimizer):
    """Skeleton of a round-based method: ``period`` local steps, then :meth:`_round` (subclasses)."""

    records_per_epoch = False   # talks once a round: the trainer logs every round
    _tag = "rounds"

    def _round_setup(self, model: torch.nn.Module, groups, period: int) -> None:
        self._method_setup(model, groups.world)
        self._torch_world = groups.world   # torch.distributed: ``.pg`` is what PyTorch's averagers take
        self._period, self._rounds = period, 0
        self._buffers = [b for b in model.buffers() if b.is_floating_point()]
        self._snapshot: Optional[List[torch.Tensor]] = None   # the last round's parameters and buffers

    def _communicate(self) -> None:   # local steps: no gradient traffic
        pass

    def _after_step(self) -> None:
        self._local_step_done(self._steps + 1)

    def _local_step_done(self, step: int) -> None:
        if step % self._period == 0:
            self._close_round(step)

    def consensus(self) -> dict:
        """A round now (collective: every rank must call it); the trainer calls it for a last, short round."""
        return self._close_round(self._steps)

    def _close_round(self, step: int) -> dict:
        """The round after ``step`` steps."""
        with self._traffic.measure(self._tag):
            self._round()
            self._average_buffers()
        return self._round_closed()

    def _round_closed(self) -> dict:
        self._rounds += 1
        self._snapshot = [p.detach().clone() for p in self._round_params()] + [b.clone() for b in self._buffers]
        return {"round": self._rounds}

    def _round(self) -> None:
        raise NotImplementedError

    def _round_params(self) -> List[torch.Tensor]:
        """The parameters of the round's model (what :meth:`consensus_weights` shows)."""
        return self._params

    def _average(self, params, tier_group, what: str) -> None:
        """PyTorch's ``average_parameters`` over ``tier_group`` (one of our torch.distributed communicators),
        recorded in the ledger as the one flat allreduce it is."""
        t0 = time.perf_counter()
        if tier_group.size > 1:   # one rank: no torch.distributed group, nothing to average
            with watchdog.waiting(what, world=tier_group.tier == "world", transport=True):
                utils.average_parameters(iter(params), tier_group.pg)
        self._record(params, tier_group, t0)

    def _record(self, params, tier_group, t0: float) -> None:
        payload = sum(p.numel() * p.element_size() for p in params)
        record_ring(tier_group, "allreduce", [payload] * tier_group.size, time.perf_counter() - t0, self._tag)

    def _average_buffers(self) -> None:
        average_buffers(self._model, self._world, tag=self._tag)

    # -- the harness: the last round's model ---------------------------------------------------------------
    @contextlib.contextmanager
    def consensus_weights(self):
        """The model holds the last round's average (parameters and buffers, the same on every rank) inside."""
        live = [p.detach() for p in self._params] + self._buffers
        if self._snapshot is None:   # no round yet: the broadcast start, the same everywhere
            yield
            return
        saved = [t.clone() for t in live]
        for t, s in zip(live, self._snapshot):
            t.copy_(s)
        try:
            yield
        finally:
            for t, s in zip(live, saved):
                t.copy_(s)

    def finalize(self) -> None:
        """Leave the last round's model in place on every rank (the trainer runs a last round first)."""
        if self._snapshot is not None:
            with torch.no_grad():
                for t, s in zip([p.detach() for p in self._params] + self._buffers, self._snapshot):
                    t.copy_(s)

    def rounds_done(self) -> int:
        return self._rounds

    def stats(self) -> Dict[str, Any]:
        return dict(MethodOptimizer.stats(self), rounds=self._rounds)   # mixed in: no super() to MethodOptimizer

    def _method_state(self) -> Dict[str, Any]:
        return {"rounds": self._rounds, "snapshot": self._snapshot, **self._round_state()}

    def _load_method_state(self, state: Dict[str, Any]) -> None:
        self._rounds = int(state.pop("rounds"))
        self._snapshot = state.pop("snapshot")
        self._load_round_state(state)

    def _round_state(self) -> Dict[str, Any]:
        return {}

    def _load_round_state(self, state: Dict[str, Any]) -> None:
        pass


class _LocalSGD(_RoundAveraging):
    """Parameters averaged over the world every ``period`` steps by PyTorch's ``PeriodicModelAverager``."""

    def __init__(self, params, model, groups, period):
        super(self.__class__, self).__init__(params)
        self._round_setup(model, groups, period)
        self._averager = _started(averagers.PeriodicModelAverager(
            period=period, warmup_steps=0, process_group=groups.world.pg)) if groups.world.size > 1 else None

    def _local_step_done(self, step: int) -> None:
        t0 = time.perf_counter()
        if self._averager is not None:
            with watchdog.waiting("local SGD averaging", world=True, transport=True):
                self._averager.average_parameters(self._params)   # averages when its step says so
        if step % self._period == 0:
            self._world_round_done(step, t0)

    def _world_round_done(self, step: int, t0: float) -> None:
        """The averager averaged over the world: record it, average the buffers, keep the round's model."""
        with self._traffic.measure(self._tag):
            self._record(self._params, self._torch_world, t0)
            self._average_buffers()
        self._round_closed()

    def _round(self) -> None:   # a round asked for between periods (the trainer's last, short one)
        self._average(self._params, self._torch_world, "local SGD averaging")

    def _round_state(self):
        return {"averager_step": self._averager.step if self._averager is not None else None}

    def _load_round_state(self, state):
        if self._averager is not None:
            self._averager.step = int(state["averager_step"])


class _HierarchicalLocalSGD(_LocalSGD):
    """PyTorch's ``HierarchicalModelAverager``: the node's ranks every ``intra_period`` steps, the world
    every ``period``."""

    def __init__(self, params, model, groups, period, intra_period):
        super(self.__class__, self).__init__(params)   # the user's optimizer (see mix_into)
        self._round_setup(model, groups, period)
        self._intra_period = intra_period
        world_size = groups.world.size
        levels = OrderedDict([(intra_period, groups.intra.size), (period, world_size)]) if intra_period < period \
            else OrderedDict([(period, world_size)])
        self._averager = _started(HierarchicalModelAverager(
            levels, warmup_steps=0, process_group=groups.world.pg)) if world_size > 1 else None
        self._node_group = groups.intra   # the same ranks as PyTorch's subgroup (checked at construction)

    def _local_step_done(self, step: int) -> None:
        t0 = time.perf_counter()
        if self._averager is not None:
            with watchdog.waiting("hierarchical local SGD averaging", world=True, transport=True):
                self._averager.average_parameters(self._params)
        if step % self._period == 0:
            self._world_round_done(step, t0)
        elif step % self._intra_period == 0:
            with self._traffic.measure(self._tag):
                self._record(self._params, self._node_group, t0)


class _DiLoCo(_RoundAveraging):
    """Inner steps with the user's optimizer, then an outer Nesterov SGD step on the averaged
    pseudo-gradient; every rank restarts from the new global parameters."""

    def __init__(self, params, model, groups, period, outer_lr, outer_momentum):
        super(self.__class__, self).__init__(params)
        self._round_setup(model, groups, period)
        self._global = [p.detach().clone() for p in self._params]
        # torch refuses Nesterov without momentum; with none the two are the same step
        self._outer = torch.optim.SGD(self._global, lr=outer_lr, momentum=outer_momentum,
                                      nesterov=outer_momentum > 0)

    def _round(self) -> None:
        # 1. the locals averaged (PyTorch's helper); 2. Δ = θ_global − mean θ_r; 3. the outer step; 4. restart
        self._average(self._params, self._torch_world, "DiLoCo averaging")
        with torch.no_grad():
            for g, p in zip(self._global, self._params):
                g.grad = g - p.detach()
            self._outer.step()
            for g, p in zip(self._global, self._params):
                p.copy_(g)

    def _round_params(self):
        return self._global

    def _round_state(self):
        return {"global": [g.clone() for g in self._global], "outer": self._outer.state_dict()}

    def _load_round_state(self, state):
        with torch.no_grad():
            for g, s in zip(self._global, state["global"]):
                g.copy_(s)
        self._outer.load_state_dict(state["outer"])


def _wrap(what: str, optimizer, model, backend, settings: Dict[str, Any], checks, method_cls, *args):
    """Checks agreed on every rank, rank 0's model broadcast, the method mixed into the user's optimizer on
    the package's torch.distributed groups for the model's device (nccl for CUDA, gloo otherwise)."""
    def all_checks():
        check_wrapping(optimizer, model)
        checks()
        return None, settings
    agreement.checked_construction(what, backend, model, all_checks)
    groups = comm_groups("nccl" if any(p.is_cuda for p in model.parameters()) else "gloo")
    broadcast_model(model, groups.world)
    return mix_into(optimizer, method_cls, model, groups, *args)


def LocalSGD(optimizer: torch.optim.Optimizer, model: torch.nn.Module, period: int = 100,
             backend: Optional[str] = None):
    """Local SGD: ``period`` steps of ``optimizer`` on each rank, then the parameters averaged over the world
    (PyTorch's ``PeriodicModelAverager``). Collective; rank 0's model is broadcast first.

    Arguments:
        period: steps between averaging rounds (the round period PruneX's ``local_steps`` sets).
        backend: the package's backend for ``init`` (the averaging itself runs on torch.distributed).

    Returns:
        The wrapped optimizer, with ``consensus()``, ``stats()`` and the harness interface."""
    def checks():
        _integer("period", period)
    return _wrap("the local SGD optimizer", optimizer, model, backend, {"period": period}, checks, _LocalSGD, period)


def HierarchicalLocalSGD(optimizer: torch.optim.Optimizer, model: torch.nn.Module, period: int = 100,
                         intra_period: Optional[int] = None, backend: Optional[str] = None):
    """Hierarchical local SGD: parameters averaged within each node every ``intra_period`` steps and over
    the world every ``period`` steps (PyTorch's ``HierarchicalModelAverager``). Collective.

    Arguments:
        period: steps between world averaging rounds.
        intra_period: steps between node averaging (must divide ``period``; default: the largest divisor of
            ``period`` not above a quarter of it).
        backend: the package's backend for ``init``.

    Returns:
        The wrapped optimizer, with ``consensus()``, ``stats()`` and the harness interface."""
    if intra_period is None and isinstance(period, int) and period >= 1:
        intra_period = max(d for d in range(1, max(1, period // 4) + 1) if period % d == 0)

    def checks():
        _integer("period", period)
        _integer("intra_period", intra_period)
        if period % intra_period:
            raise ValueError(f"intra_period {intra_period} must divide period {period}")
        topo = runtime.topology()
        blocks = [list(range(i * topo.local_size, (i + 1) * topo.local_size)) for i in range(topo.num_nodes)]
        if [list(r) for r in topo.node_ranks] != blocks:
            raise ValueError(f"hierarchical local SGD needs each node's ranks to be consecutive (PyTorch's "
                             f"HierarchicalModelAverager forms node groups from rank blocks); nodes here: "
                             f"{[list(r) for r in topo.node_ranks]}")
    return _wrap("the hierarchical local SGD optimizer", optimizer, model, backend,
                 {"period": period, "intra_period": intra_period}, checks, _HierarchicalLocalSGD, period, intra_period)


def DiLoCo(optimizer: torch.optim.Optimizer, model: torch.nn.Module, period: int = 100, outer_lr: float = 0.7,
           outer_momentum: float = 0.9, backend: Optional[str] = None):
    """DiLoCo: ``period`` inner steps of ``optimizer``, then an outer Nesterov SGD step
    (``outer_lr``, ``outer_momentum``) on the averaged pseudo-gradient. Collective.

    Arguments:
        period: inner steps between outer steps (rounds).
        outer_lr, outer_momentum: the outer optimizer's (paper: 0.7 and 0.9); ``outer_lr=1``,
            ``outer_momentum=0`` is local SGD.
        backend: the package's backend for ``init``.

    Returns:
        The wrapped optimizer, with ``consensus()``, ``stats()`` and the harness interface."""
    def checks():
        _integer("period", period)
        if not (isinstance(outer_lr, (int, float)) and not isinstance(outer_lr, bool) and outer_lr > 0):
            raise ValueError(f"outer_lr must be a number > 0, got {outer_lr!r}")
        if not (isinstance(outer_momentum, (int, float)) and 0 <= outer_momentum < 1):
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
    return _wrap("the DiLoCo optimizer", optimizer, model, backend,
                 {"period": period, "outer": (outer_lr, outer_momentum)}, checks, _DiLoCo,
                 period, outer_lr, outer_momentum)
