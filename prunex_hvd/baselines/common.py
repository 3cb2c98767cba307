"""What every baseline shares: the wrapper skeleton, byte accounting, and the initial broadcast.

A baseline is a :class:`MethodOptimizer` subclass mixed into the user's optimizer class (as Horovod does),
so LR schedulers and ``isinstance`` keep working. Subclasses implement :meth:`MethodOptimizer._communicate`
(turn each rank's gradients into the synchronised ones, in place) and may add :meth:`_after_step`,
:meth:`_method_state` / :meth:`_load_method_state` and :meth:`_extra_stats`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterable, List, Optional

import torch

from ..engine.buckets import BucketLayout
from ..dist.comm.accounting import ledger as default_ledger, ring_cross_node_bytes
from ..optimizer import check_wrapping, mix_into  # noqa: F401  (the baselines' wrapping, shared with PruneX's)


class Traffic:
    """Bytes one method moved, measured from the ledger around its own collectives (ring model):
    ``inter`` crossed node boundaries, ``intra`` stayed inside a node, ``cross_rack`` the part of ``inter`` that
    crossed a rack boundary (all of it without racks)."""

    def __init__(self, ledger=None):
        self.ledger = ledger or default_ledger()
        self.inter = self.intra = self.cross_rack = 0

    @contextlib.contextmanager
    def measure(self, tag: str):
        before = self.ledger.summary()["total"]
        with self.ledger.tagged(tag):
            yield
        after = self.ledger.summary()["total"]
        cross = after["cross_node_bytes"] - before["cross_node_bytes"]
        self.inter += cross
        self.intra += after["wire_bytes"] - before["wire_bytes"] - cross
        self.cross_rack += after["cross_rack_bytes"] - before["cross_rack_bytes"]

    def state(self) -> Dict[str, int]:
        return {"inter": self.inter, "intra": self.intra, "cross_rack": self.cross_rack}

    def load(self, state: Dict[str, int]) -> None:
        self.inter, self.intra = int(state["inter"]), int(state["intra"])
        self.cross_rack = int(state.get("cross_rack", self.inter))   # older checkpoints: every node a rack


def dense_allreduce_cross_bytes(numel: int, itemsize: int, world) -> int:
    """Bytes this rank would send across nodes for a dense ring allreduce of ``numel`` elements over the
    world group: the counterfactual every method's ``dense_inter_bytes`` is measured against."""
    return ring_cross_node_bytes("allreduce", [numel * itemsize] * world.size, world.rank, world.nodes)


def broadcast_model(model: torch.nn.Module, world, bucket_bytes: int = 32 * 2**20) -> None:
    """Rank 0's parameters and float buffers to every rank (one collective per bucket), as Horovod's
    ``broadcast_parameters`` does; tagged ``broadcast-init`` and not counted as training traffic."""
    tensors = [p.detach() for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]
    if not tensors:
        return
    layout = BucketLayout([t.numel() for t in tensors], tensors[0].dtype, tensors[0].device, bucket_bytes)
    for k, t in enumerate(tensors):
        layout.views[k].copy_(t.reshape(-1))
    with world.ledger.tagged("broadcast-init"):
        for buf in layout.buffers:
            world.broadcast_(buf, root=0)
    for k, t in enumerate(tensors):
        t.copy_(layout.views[k].view_as(t))


def average_buffers(model: torch.nn.Module, world, tag: str = "eval") -> None:
    """Average the float buffers (BatchNorm running statistics) over the world, tagged ``tag``: by default
    ``eval``, outside any method's :class:`Traffic` (bookkeeping for evaluation, not training traffic); the
    round-based methods average them in every round, as training traffic."""
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if not buffers or world.size == 1:
        return
    flat = torch.cat([b.reshape(-1) for b in buffers])
    with world.ledger.tagged(tag):
        world.allreduce_(flat, "avg")
    offset = 0
    for b in buffers:
        b.copy_(flat[offset: offset + b.numel()].view_as(b))
        offset += b.numel()


class MethodOptimizer(torch.optim.Optimizer):
    """Skeleton mixed into the user's optimizer class (see :func:`mix_into`). Not used on its own."""

    records_per_epoch = True   # talks every step: the trainer logs once an epoch

    def consensus(self) -> None:
        """Nothing to do: every step already communicated (the :class:`prunex_hvd.app.methods.Method` contract)."""
        return None

    def _method_setup(self, model: torch.nn.Module, world, ledger=None) -> None:
        self._model, self._world = model, world
        self._traffic = Traffic(ledger or world.ledger)
        self._steps = 0
        self._dense_inter = 0
        self._params: List[torch.nn.Parameter] = [p for g in self.param_groups for p in g["params"]]
        self._dense_step_bytes = dense_allreduce_cross_bytes(sum(p.numel() for p in self._params),
                                                             self._params[0].element_size(), world)

    def step(self, closure=None):
        if closure is not None:
            raise ValueError(f"{type(self).__name__} does not take a closure: gradients are synchronised "
                             "between backward() and step()")
        with self._traffic.measure(self._tag):
            self._communicate()
        self._dense_inter += self._dense_step_bytes
        loss = super(self.__class__, self).step()
        self._after_step()
        self._steps += 1
        return loss

    _tag = "gradients"

    def _communicate(self) -> None:
        raise NotImplementedError

    def _after_step(self) -> None:
        pass

    @contextlib.contextmanager
    def consensus_weights(self):
        """The model to evaluate: the weights (identical on every rank) with the BatchNorm statistics
        averaged over the ranks, which gradient methods leave per rank, as Horovod does. Restored after."""
        buffers = [b for b in self._model.buffers() if b.is_floating_point()]
        saved = [b.clone() for b in buffers]
        average_buffers(self._model, self._world)
        try:
            yield
        finally:
            for b, old in zip(buffers, saved):
                b.copy_(old)

    def finalize(self) -> None:
        """Every rank holds the trained weights already; average the BatchNorm statistics so every rank holds
        the same model."""
        average_buffers(self._model, self._world)

    def layer_density(self) -> Dict[str, float]:
        return {}

    def density(self) -> float:
        return 1.0

    def _extra_stats(self) -> Dict[str, Any]:
        return {}

    def rounds_done(self) -> int:
        """Communication rounds so far (one a step): cheap, for the training loop's every step."""
        return self._steps

    def stats(self) -> Dict[str, Any]:
        return {"rounds": self._steps, "steps": self._steps, "inter_bytes": self._traffic.inter,
                "intra_bytes": self._traffic.intra, "dense_inter_bytes": self._dense_inter,
                "cross_rack_bytes": self._traffic.cross_rack,
                "density": self.density(), "layer_density": self.layer_density(), **self._extra_stats()}

    def _method_state(self) -> Dict[str, Any]:
        return {}

    def _load_method_state(self, state: Dict[str, Any]) -> None:
        pass

    def state_dict(self):
        return self._with_method_state(super(self.__class__, self).state_dict())

    def load_state_dict(self, state_dict):
        state_dict, method = self._split_method_state(state_dict)
        super(self.__class__, self).load_state_dict(state_dict)
        self._restore_method_state(method)

    # the three halves of the above, also bound onto Horovod's own optimizer by `dense`
    def _with_method_state(self, sd):
        sd["method"] = {"steps": self._steps, "traffic": self._traffic.state(), "dense_inter": self._dense_inter,
                        **self._method_state()}
        return sd

    def _split_method_state(self, state_dict):
        state_dict = dict(state_dict)
        method = state_dict.pop("method", None)
        if method is None:
            raise ValueError(f"this state dict has no 'method' state for {type(self).__name__}: save it with the "
                             "wrapped optimizer's state_dict()")
        return state_dict, dict(method)

    def _restore_method_state(self, method) -> None:
        self._steps = int(method.pop("steps"))
        self._traffic.load(method.pop("traffic"))
        self._dense_inter = int(method.pop("dense_inter"))
        self._load_method_state(method)


def allreduce_gradients(params: List[torch.nn.Parameter], layout: BucketLayout, world) -> None:
    """Every parameter's gradient averaged over ``world``, one allreduce per bucket of ``layout`` (a parameter
    unused this step takes part with zeros: the same buckets everywhere)."""
    for k, p in enumerate(params):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        layout.views[k].copy_(p.grad.reshape(-1))
    for buf in layout.buffers:
        world.allreduce_(buf, "avg")
    for k, p in enumerate(params):
        p.grad.copy_(layout.views[k].view_as(p.grad))


def flat_layout(params: Iterable[torch.Tensor], bucket_mb: float) -> Optional[BucketLayout]:
    params = list(params)
    if not params:
        return None
    return BucketLayout([p.numel() for p in params], params[0].dtype, params[0].device, int(bucket_mb * 2**20))
