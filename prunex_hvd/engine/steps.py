"""What the engine adds to every local step: the node's gradient average (``node_sync``), the proximal term
ρ1(θ − z_i + u), and in the retraining phase θ held on the frozen structure with each pruned layer computing on its
kept block (:mod:`prunex_hvd.engine.compact_compute`).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from . import compact_compute, sparsity
from .buckets import BucketLayout
from .masks import MaskPolicy
from .state import ConsensusState
from .verdict import IN_STEP, NodeGuard


class StepHooks:
    """The per-step side of the engine, called by the wrapped optimizer's ``step()`` in this order:
    :meth:`sync_node_grads`, :meth:`add_proximal_grad`, the user's step, :meth:`after_step`."""

    def __init__(self, state: ConsensusState, model: torch.nn.Module, masks: MaskPolicy, exchange, guard: NodeGuard,
                 traffic):
        self.state, self.masks, self.exchange, self.guard, self.traffic = state, masks, exchange, guard, traffic
        self.grad_buckets: Optional[BucketLayout] = None   # node_sync's gradient buckets, made at the first step
        # compact compute: the layers whose weight is a structured entry, made to compute on its frozen block
        modules = dict(model.named_modules())
        self.layers: List[tuple] = []
        for e in state.structured:
            layer = modules.get(e.name.rpartition(".")[0])
            if layer is not None and getattr(layer, "weight", None) is e.param and compact_compute.supports(layer):
                self.layers.append((e, layer))
        # θ is checked on the structure over these layers' weights alone: the gradient-mask skip needs them all
        self._layers_cover_structure = len(self.layers) == len(state.structured)
        self.computing_compact = False
        self._shift: List[torch.Tensor] = []
        self._shift_on_structure = False
        self._prox_groups: list = []

    def forget_layout(self) -> None:
        """The masks were set anew: the gradient buckets are made again at the next step."""
        self.grad_buckets = None

    def refresh_prox(self, in_flight=None) -> None:
        """Cache ρ1(u − z_i) and group entries by ρ1, so a step is two fused foreach adds per group. A half
        precision model caches z_i − u instead (see :meth:`add_proximal_grad`). With a round in flight
        (``overlap``) the steps already pull toward its z_i, with its u (u + (θ − z_i)), at the ρ1 they had."""
        s, f = self.state, in_flight
        same = s.state_dtype == s.dtype
        self._shift = []
        for k, e in enumerate(s.entries):   # one new tensor each: u + du is formed in it (the fold's u, bitwise)
            z_i = e.z_i if f is None else f.z_i[k]
            if f is None:
                shift = (e.u - z_i).mul_(e.rho1) if same else z_i - e.u
            else:
                u = torch.add(e.u, f.du[k])
                shift = u.sub_(z_i).mul_(e.rho1) if same else torch.sub(z_i, u, out=u)
            self._shift.append(shift)
        # once frozen, the shift is cut to the structure too: with θ and the gradient on it, so is the whole
        # proximal gradient, and add_proximal_grad can skip the mask pass (grads_on_structure)
        self._shift_on_structure = self.masks.retraining
        if self._shift_on_structure:
            support = dict(zip(map(id, s.structured), self.masks.support()))
            for e, shift in zip(s.entries, self._shift):
                if id(e) in support:
                    shift.mul_(support[id(e)])
        groups: Dict[float, List[int]] = {}
        for k, e in enumerate(s.entries):
            groups.setdefault(e.rho1, []).append(k)
        self._prox_groups = list(groups.items())

    @property
    def syncs_node_grads(self) -> bool:
        """Whether :meth:`sync_node_grads` averages anything: ``node_sync`` on a node of more than one rank."""
        return self.state.config.node_sync and self.state.topo.local_size > 1

    def sync_node_grads(self, steps: Optional[int] = None) -> None:
        """``node_sync``: every gradient averaged over the node's ranks (one allreduce per bucket on the fast
        links), before the proximal term is added. The node's ranks share θ, u and z_i, so they then take the
        same step: the node is one data-parallel worker. A parameter with no gradient on this rank counts as
        zero in the mean; whether any rank of the node has one rides along (a flag per parameter in the last
        bucket, as DDP's map of used parameters): if one has, every rank steps it with the mean, zero or not, and
        if none has, none does, so a missing gradient and a zero one are treated alike.

        Once the masks are frozen only each structured weight's kept block travels: the pruned entries'
        gradients are masked right after anyway, so they come back 0 without being sent, and the node's links
        carry the pruned model (half of ResNet-18's gradient at ``channel:0.5``).

        ``steps``: the optimizer steps this rank has taken, for the guard (which comes first)."""
        if not self.syncs_node_grads:
            return
        self.guard(IN_STEP, steps)
        s, compact = self.state, self.masks.retraining
        if self.grad_buckets is None:   # made again at the freeze (and on a load); the last view: the flags
            self.grad_buckets = BucketLayout([e.compact_numel() if compact else e.param.numel() for e in s.entries]
                                             + [len(s.entries)], s.dtype, s.device, s.bucket_bytes)
        has_grad = self.grad_buckets.views[len(s.entries)]
        has_grad.copy_(torch.tensor([e.param.grad is not None for e in s.entries]))   # one copy, not one per entry
        for k, e in enumerate(s.entries):   # a missing gradient counts as zero in the mean
            view = self.grad_buckets.views[k]
            if e.param.grad is None:
                view.zero_()
            elif compact and e.structured:
                sparsity.shrink_into(e.param.grad, e.row_idx, e.col_idx, view, plan=e.plan)
            else:
                view.copy_(e.param.grad.reshape(-1))
        before = self.exchange.ledger.summary()
        self.exchange.node_average_grads(self.grad_buckets)
        self.traffic.count(before)
        for k, e in enumerate(s.entries):
            mean = self.grad_buckets.views[k]
            if e.param.grad is None:
                if not has_grad[k]:   # no rank of the node has one: the flags' mean is shared, so none steps it
                    continue
                e.param.grad = torch.empty_like(e.param)
            if compact and e.structured:
                sparsity.recover(mean, e.row_idx, e.col_idx, e.param.shape, out=e.param.grad, plan=e.plan)
            else:
                e.param.grad.copy_(mean.view_as(e.param))

    def add_proximal_grad(self, grads_on_structure: bool = False) -> None:
        """grad += ρ1(θ − z_i + u): the gradient of the intra-node penalty (Eq. 8). Once frozen the result is
        masked to the structure, a pass over every structured gradient; ``grads_on_structure`` says the gradients
        are zero outside it already (``node_sync``'s compact average, recovered in this very step, as
        :meth:`prunex_hvd.DistributedOptimizer.step` does), and with θ on it (compact compute on) the pass is
        skipped: every term is zero there."""
        s = self.state
        for rho1, ks in self._prox_groups:
            live = [k for k in ks if s.entries[k].param.grad is not None]
            if not live:
                continue
            grads = [s.entries[k].param.grad for k in live]
            thetas = [s.entries[k].param.detach() for k in live]
            if s.state_dtype == s.dtype:
                torch._foreach_add_(grads, thetas, alpha=rho1)
                torch._foreach_add_(grads, [self._shift[k] for k in live])
            else:   # θ − (z_i − u) in float32 first: in half precision ρ1θ and ρ1(u − z_i) cancel badly
                prox = torch._foreach_sub(thetas, [self._shift[k] for k in live])
                torch._foreach_mul_(prox, rho1)
                torch._foreach_add_(grads, prox)
        if self.masks.retraining and not (grads_on_structure and self.computing_compact
                                          and self._layers_cover_structure and self._shift_on_structure
                                          and self.syncs_node_grads):
            torch._foreach_mul_([e.param.grad for e in s.structured if e.param.grad is not None],
                                [m for e, m in zip(s.structured, self.masks.support()) if e.param.grad is not None])

    def after_step(self) -> None:
        """Retraining phase (PruneX §4.5): once masks are frozen, θ stays on the frozen structure, so training
        is ordinary data-parallel training of the pruned model (momentum would move pruned entries)."""
        if self.masks.retraining:
            with torch.no_grad():
                torch._foreach_mul_([e.param for e in self.state.structured], self.masks.support())
            if not self.computing_compact:
                self.set_compact_compute(on_structure=True)

    def set_compact_compute(self, afresh: bool = False, on_structure: bool = False) -> None:
        """Each structured conv and linear multiplies only its kept block while θ is on the frozen structure
        (:mod:`prunex_hvd.engine.compact_compute`). Exact: θ is zero outside each block. Checked after every round
        (and fold), which can leave θ off it (``restart="none"`` at the freeze; an overlapped fold moving θ by
        z − θ_sent with a θ_sent from before the masking); the layers then multiply in full until the next step
        masks θ (:meth:`after_step`, ``on_structure``: no check needed). Plain layers before the freeze and once
        finalized. Decided from the engine's state and θ alone, so a resumed run switches where the
        uninterrupted one did (``afresh``: decided again, as by a new engine)."""
        if afresh:
            for _, layer in self.layers:
                compact_compute.compute_in_full(layer)
            self.computing_compact = False
        on = self.masks.retraining and not self.state.finalized
        if on and not on_structure:
            with torch.no_grad():
                on = all(torch.equal(sparsity.apply_masks(e.param, e.rows, e.cols), e.param) for e, _ in self.layers)
        if on == self.computing_compact:
            return
        for e, layer in self.layers:
            if on:
                compact_compute.compute_on_support(layer, e.rows, e.cols)
            else:
                compact_compute.compute_in_full(layer)
        self.computing_compact = on

    def start_frozen(self) -> None:
        """``freeze_round=0``: the masks are Π_S's support on the start point θ0 (the same on every rank after the
        broadcast; rank 0's choice handed down), frozen before any step; z = z_i = θ = Π_S(θ0), the duals at 0, ρ
        as configured (docs/algorithm.md, "Masks chosen at the start")."""
        self.masks.freeze()
        self.forget_layout()
        self.masks.say_frozen()
        with torch.no_grad():
            for e in self.state.structured:
                e.z_i = e.z.clone()
                e.param.copy_(e.z)
        self.refresh_prox()
        self.set_compact_compute()
