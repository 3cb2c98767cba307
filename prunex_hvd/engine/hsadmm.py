"""One H-SADMM consensus round (PruneX Algorithm 1, made exact in docs/algorithm.md), over the node and leader groups.

Every rank of node i holds the same z_i, v_i and z; leaders (local rank 0) alone talk across nodes. A round:

 1. intra-node allreduce-SUM of θ + u and of the float buffers   (dense, fast links)
 2. node candidate z̃_i, the exact argmin in z_i                  (admm.node_candidate, on every rank)
 3. z_i = Π_S(z̃_i); leaders OR the row/col masks                (z_i = z̃_i ⊙ m once masks are frozen)
 4. leaders shrink z_i + v_i to the global support, average the compact buckets across nodes, and
    broadcast them to their node                                  (Groups.leaders_then_node_)
    with racks (three tiers): sum them over the rack, form the rack's w_r, average w_r + t_r across the
    spine, back down the rack and the node                         (_rack_exchange)
 5. every rank recovers z from the compact buckets (one pass per layer)
 6. verdict: the residuals' job-wide sum carries every rank's round, step count and inf/NaN flags; a round
    that cannot be trusted is refused on every rank before any state changes
 7. v_i += z_i − z,  u += θ − z_i; the float buffers take the round's average
 8. residuals (r/s intra, r/s inter) per layer; adaptive ρ with dual rescaling
 9. masks frozen when stable, at exactly the requested structure (then θ trains on it: the retraining phase)
10. with ``restart="global"`` every rank's θ starts the next round at z

``overlap``: once the masks are frozen a round stops after phase 4 has started the leaders' exchange; the next
round (or the ``overlap``-th local step after it, ``complete()``, ``finalize()``; a mid-flight ``state_dict()`` for
the wire alone) waits for it and runs phases 5–10, while the local steps in between pull toward the new z_i
(docs/algorithm.md, "Overlapped rounds").

Between rounds each local step adds ρ1(θ − z_i + u) to the gradient (:meth:`HSADMM.add_proximal_grad`); with
``node_sync`` the node's ranks first average their gradients (:meth:`HSADMM.sync_node_grads`), so each node
steps as one data-parallel worker, and a guard before each step's average and each round refuses ranks that are
not at the same point (:meth:`HSADMM._node_guard`).

Residuals count both tiers as consensus ADMM does (:mod:`prunex_hvd.engine.admm`):
s_intra = ρ1√(P·Σ_i‖Δz_i‖²), s_inter = ρ2√M‖Δz‖. With one node (or ``hierarchical=False``) there is no inter-node tier: z = z_i, r_inter is
0 by construction, so ρ2 is not adapted and no inter residuals are reported. With racks, r_inter/s_inter are
the nodes' against their rack's w_r and r_spine/s_spine the racks' against z (ρ3; docs/algorithm.md).

Precision: the consensus state and its arithmetic are float32 for float16/bfloat16 models
(:func:`prunex_hvd.engine.admm.state_dtype`); what travels (θ + u, the compact z) is in the model's dtype.

The consensus model (:meth:`HSADMM.finalize`, :meth:`HSADMM.consensus_weights`) is the last round's: z and the
float buffers averaged in that round, the same on every rank whatever steps were taken since.
"""
from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from ..dist import watchdog
from ..dist.comm.accounting import ledger as default_ledger, ring_cross_node_bytes
from . import admm, compact_compute, sparsity
from .buckets import BucketLayout
from .config import PAYLOAD_DTYPES, ConsensusConfig, Structure

log = logging.getLogger(__name__)


@dataclass
class Entry:
    """One model parameter in the consensus."""
    name: str
    param: torch.nn.Parameter
    spec: Optional[sparsity.StructureSpec]   # None: dense consensus
    u: torch.Tensor
    z_i: torch.Tensor
    v: torch.Tensor
    z: torch.Tensor
    rho1: float
    rho2: float
    rows: Optional[torch.Tensor] = None      # global structured masks (bool), GEMM view
    cols: Optional[torch.Tensor] = None
    row_idx: Optional[torch.Tensor] = None
    col_idx: Optional[torch.Tensor] = None
    plan: Optional[sparsity.Plan] = None   # shrink and recover as one pass each, while masks hold
    residuals: Dict[str, float] = field(default_factory=dict)
    ef: Optional[torch.Tensor] = None      # a narrow payload's rounding error, sent again next round (leaders)
    w: Optional[torch.Tensor] = None       # three tiers: the rack consensus w_r (v is then z_i's dual against it)
    t: Optional[torch.Tensor] = None       # w_r's dual against z
    rho3: float = 0.0                      # w_r's pull toward z
    ef_spine: Optional[torch.Tensor] = None   # three tiers, narrow payload: the rack leader's rounding error

    def set_masks(self, rows: torch.Tensor, cols: torch.Tensor) -> None:
        self.rows, self.cols = rows, cols
        self.row_idx, self.col_idx = sparsity.masks_to_indices(rows, cols)
        self.plan = sparsity.gather_plan(self.row_idx, self.col_idx, self.param.shape)

    @property
    def structured(self) -> bool:
        return self.spec is not None

    def compact_numel(self) -> int:
        if not self.structured:
            return self.param.numel()
        return len(self.row_idx) * len(self.col_idx)


@dataclass
class _InFlight:
    """A round whose inter-node exchange is in flight (``overlap``): what its fold needs."""
    steps: Optional[int]
    nonfinite: List[bool]
    z_i: List[torch.Tensor]          # the node's new z_i
    du: List[torch.Tensor]           # u's step, θ − z_i, θ as the round sent it
    theta_sq: List[torch.Tensor]     # ‖θ − z_i‖² per entry, the same θ
    masks_before: tuple              # put back if the round is refused
    layout: BucketLayout             # the compact buckets: the average, once received
    works: list                      # the leaders' async allreduces (none once received)
    pending_ef: Optional[list]       # a narrow payload's new rounding errors (leaders)
    theta_sent: Optional[List[torch.Tensor]] = None   # θ as sent (restart: the fold rebases the steps since on z)
    received: bool = False
    steps_since: int = 0             # local steps taken since it started (overlap_steps folds it in)


NO_BYTES = {"inter": 0, "intra": 0, "inter_consensus": 0, "dense_inter": 0, "cross_rack": 0}
_IN_STEP, _AT_ROUND = 1.0, 2.0   # where a rank is, in node_sync's guard


def _ranks(ranks: List[int]) -> str:
    return ",".join(map(str, ranks))


class HSADMM:
    """The consensus state of one rank and the round that updates it, under ``config`` (its knobs, ``rho_max`` a
    number: :meth:`ConsensusConfig.with_rho_max_from` resolves ``"auto"``) on ``structure`` (what they resolve to
    on the model; resolved here when not given). Transport comes from ``groups`` (a
    :class:`prunex_hvd.dist.comm.Groups`); the math from :mod:`prunex_hvd.engine.admm` and
    :mod:`prunex_hvd.engine.sparsity`."""

    def __init__(self, model: torch.nn.Module, topo, groups, config: ConsensusConfig,
                 structure: Optional[Structure] = None, ledger=None):
        if config.rho_max == "auto":
            raise ValueError("rho_max='auto' is derived from the optimizer's lr and momentum, which the engine does "
                             "not see: pass config.with_rho_max_from(lr, momentum), or a number")
        self.topo, self.groups, self.config = topo, groups, config
        structure = structure or Structure.resolve(model, config)
        self.couplings = dict(structure.couplings)   # {consumer conv: producer conv}, pruned as one channel group
        self.streams = list(structure.streams)       # [(readers, writers)]: one channel group per residual stream
        # channel_budget="global": the layers sharing one budget of kept weights (their channels their own)
        self.budget_layers = sparsity.own_channel_layers(structure.specs, self.couplings, self.streams) \
            if config.channel_budget == "global" else []
        self.heads = list(structure.heads)           # attention modules whose heads are kept or dropped whole
        self.bucket_bytes = int(config.bucket_mb * 2**20)
        self.ledger = ledger or default_ledger()
        params = [(n, p) for n, p in model.named_parameters()]
        self.buffers = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
        dtypes = {p.dtype for _, p in params} | {b.dtype for _, b in self.buffers}
        devices = {p.device for _, p in params} | {b.device for _, b in self.buffers}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"the consensus packs every parameter and float buffer into shared buckets, so they "
                             f"must share one dtype and device; got dtypes {sorted(map(str, dtypes))}, devices "
                             f"{sorted(map(str, devices))}")
        self.dtype, self.device = dtypes.pop(), devices.pop()   # the payload's dtype: the model's
        self.state_dtype = admm.state_dtype(self.dtype)
        self.inter_tier = topo.num_nodes > 1   # one node: z = z_i, nothing to balance across nodes
        # racks: θ → z_i → w_r → z (one rack, or one node per rack, is the two-tier round unchanged)
        self.rack_tier = self.inter_tier and config.rack_tier and bool(topo.rack_nodes) and topo.num_racks > 1
        # what crosses nodes; narrower than the state: the change since the last z, with error feedback
        self.payload_dtype = PAYLOAD_DTYPES[config.payload_dtype] or self.dtype
        self.delta_coded = (self.inter_tier and config.payload_dtype is not None
                            and self.payload_dtype.itemsize < self.state_dtype.itemsize)
        self._check_rack_tier()

        self._broadcast_model(params)
        self.entries: List[Entry] = []
        for name, p in params:
            theta = p.detach().to(self.state_dtype)
            e = Entry(name, p, structure.specs.get(name), u=torch.zeros_like(theta), z_i=theta.clone(),
                      v=torch.zeros_like(theta), z=theta.clone(), rho1=float(config.rho1), rho2=float(config.rho2),
                      ef=torch.zeros_like(theta) if self.delta_coded else None)
            if self.rack_tier:   # w_r starts where z does, its dual at zero
                e.w, e.t = theta.clone(), torch.zeros_like(theta)
                e.rho3 = float(config.rho3 if config.rho3 is not None else config.rho2)
                e.ef_spine = torch.zeros_like(theta) if self.delta_coded else None
            if e.structured:   # masks start all ones
                c_out = theta.shape[0]
                e.set_masks(torch.ones(c_out, dtype=torch.bool, device=self.device),
                            torch.ones(theta.numel() // c_out, dtype=torch.bool, device=self.device))
            self.entries.append(e)
        self.structured = [e for e in self.entries if e.structured]
        # compact_compute: the layers whose weight is a structured entry, made to compute on its frozen block
        modules = dict(model.named_modules())
        self._layers: List[tuple] = []
        for e in self.structured:
            layer = modules.get(e.name.rpartition(".")[0])
            if layer is not None and getattr(layer, "weight", None) is e.param and compact_compute.supports(layer):
                self._layers.append((e, layer))
        # θ is checked on the structure over these layers' weights alone: the gradient-mask skip needs them all
        self._layers_cover_structure = len(self._layers) == len(self.structured)
        self.round = 0
        self.frozen = False
        self.finalized = False
        self._set_compact_compute(afresh=True)   # sets _computing_compact (layers an earlier engine left compact
                                                 # are made plain)
        self._round_buffers = [b.clone() for _, b in self.buffers]   # averaged in the last round: z's partner
        self._buffer_ef = [torch.zeros_like(b, dtype=self.state_dtype) for _, b in self.buffers] \
            if self.delta_coded else []
        self._buffer_ef_spine = [torch.zeros_like(ef) for ef in self._buffer_ef] if self.rack_tier else []
        self._pending_ef: Optional[list] = None   # this round's new errors, kept once the round is accepted
        self._pending_ef_spine: Optional[list] = None   # (the rack leaders', across the spine)
        self.stable_rounds = 0
        self.mask_drift = 0.0
        self.bytes = dict(NO_BYTES)
        self._dense = self._layout([e.param.numel() for e in self.entries])
        self._grads: Optional[BucketLayout] = None   # node_sync's gradient buckets, made at the first step
        self._compact: Optional[BucketLayout] = None
        self._gathers: Dict[int, tuple] = {}   # entry -> (its bucket rows with a zero row, gather index)
        self._gathers_of: Optional[BucketLayout] = None   # the layout they index
        self._support: Optional[List[torch.Tensor]] = None   # dense masks of the retraining phase
        # ``overlap``: the round whose inter-node exchange is in flight while the next local steps run
        self.overlap = config.overlap_steps is not None and self.inter_tier
        # the local step after which the round in flight is folded in
        self.fold_after = config.overlap_steps or 0
        self._in_flight: Optional[_InFlight] = None
        self.exchange_wait_s = 0.0   # time ranks waited on the consensus exchange, all rounds
        if config.freeze_round == 0:   # masks chosen at the start: every round trains the pruned model
            self._freeze_at_start()
        else:
            self._refresh_prox()

    # -- set-up -----------------------------------------------------------------------------------------
    def _check_rack_tier(self) -> None:
        """The three-tier round needs the backend's rack and spine groups, and has no overlapped exchange (it would
        need its own fold per tier): refused on every rank alike (topology and knobs agree)."""
        if not self.rack_tier:
            return
        if (self.topo.is_leader and self.groups.rack is None) or (self.topo.is_rack_leader and self.groups.spine is None):
            raise RuntimeError(f"the {self.groups.backend} backend made no rack or spine group for rank "
                               f"{self.topo.rank}, a {'rack' if self.topo.is_rack_leader else 'node'} leader")
        if self.config.overlap is not False:
            raise ValueError(f"the rack tier ({self.topo.num_racks} racks of {self.topo.nodes_per_rack} nodes) does "
                             f"not support overlap={self.config.overlap!r}: turn it off, or set rack_tier=False "
                             f"for two tiers over all nodes")

    def _tree_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Combine ``tensor`` over the whole hierarchy and hand the result to every rank (collective): the
        leaders across nodes, or with racks the nodes of each rack, then the rack leaders across the spine."""
        if self.rack_tier:
            return self.groups.racks_then_down_(tensor, op)
        return self.groups.leaders_then_node_(tensor, op, self.topo.num_nodes)

    def _broadcast_model(self, params) -> None:
        """Rank 0's parameters and float buffers to everyone, leaders first: nothing but the leaders crosses
        nodes (the world group would route through non-leaders)."""
        tensors = [p.detach() for _, p in params] + [b for _, b in self.buffers]
        layout = self._layout([p.numel() for _, p in params])
        with self.ledger.tagged("broadcast-init"):
            for k, t in enumerate(tensors):
                layout.views[k].copy_(t.reshape(-1))
            for buf in layout.buffers:
                self._tree_(buf, "broadcast")
            for k, t in enumerate(tensors):
                t.copy_(layout.views[k].view_as(t))

    # -- every local step -------------------------------------------------------------------------------
    def _refresh_prox(self) -> None:
        """Cache ρ1(u − z_i) and group entries by ρ1, so a step is two fused foreach adds per group. A half
        precision model caches z_i − u instead (see :meth:`add_proximal_grad`). With a round in flight
        (``overlap``) the steps already pull toward its z_i, with its u (u + (θ − z_i)), at the ρ1 they had."""
        f, same = self._in_flight, self.state_dtype == self.dtype
        self._shift = []
        for k, e in enumerate(self.entries):   # one new tensor each: u + du is formed in it (the fold's u, bitwise)
            z_i = e.z_i if f is None else f.z_i[k]
            if f is None:
                shift = (e.u - z_i).mul_(e.rho1) if same else z_i - e.u
            else:
                u = torch.add(e.u, f.du[k])
                shift = u.sub_(z_i).mul_(e.rho1) if same else torch.sub(z_i, u, out=u)
            self._shift.append(shift)
        # once frozen, the shift is cut to the structure too: with θ and the gradient on it, so is the whole
        # proximal gradient, and add_proximal_grad can skip the mask pass (grads_on_structure)
        self._shift_on_structure = self._retraining_masked
        if self._shift_on_structure:
            support = dict(zip(map(id, self.structured), self._retrain_support()))
            for e, shift in zip(self.entries, self._shift):
                if id(e) in support:
                    shift.mul_(support[id(e)])
        groups: Dict[float, List[int]] = {}
        for k, e in enumerate(self.entries):
            groups.setdefault(e.rho1, []).append(k)
        self._prox_groups = list(groups.items())

    @property
    def syncs_node_grads(self) -> bool:
        """Whether :meth:`sync_node_grads` averages anything: ``node_sync`` on a node of more than one rank."""
        return self.config.node_sync and self.topo.local_size > 1

    def sync_node_grads(self, steps: Optional[int] = None) -> None:
        """``node_sync``: every gradient averaged over the node's ranks (one allreduce per bucket on the fast
        links), before the proximal term is added. The node's ranks share θ, u and z_i, so they then take the
        same step: the node is one data-parallel worker. A parameter with no gradient on this rank counts as
        zero in the mean, and gets the mean when that is not zero (so the node's ranks step it alike).

        Once the masks are frozen only each structured weight's kept block travels: the pruned entries'
        gradients are masked right after anyway, so they come back 0 without being sent, and the node's links
        carry the pruned model (half of ResNet-18's gradient at ``channel:0.5``).

        ``steps``: the optimizer steps this rank has taken, for :meth:`_node_guard` (which comes first)."""
        if not self.syncs_node_grads:
            return
        self._node_guard(_IN_STEP, steps)
        compact = self._retraining_masked
        if self._grads is None:   # made again at the freeze (and on a load)
            self._grads = BucketLayout([e.compact_numel() if compact else e.param.numel() for e in self.entries],
                                       self.dtype, self.device, self.bucket_bytes)
        for k, e in enumerate(self.entries):   # a missing gradient counts as zero in the mean
            view = self._grads.views[k]
            if e.param.grad is None:
                view.zero_()
            elif compact and e.structured:
                sparsity.shrink_into(e.param.grad, e.row_idx, e.col_idx, view, plan=e.plan)
            else:
                view.copy_(e.param.grad.reshape(-1))
        before = self.ledger.summary()
        with self.ledger.tagged("node-sync"):
            for buf in self._grads.buffers:
                self.groups.intra.allreduce_(buf, "avg")
        self._count_traffic(before)
        for k, e in enumerate(self.entries):
            mean = self._grads.views[k]
            if e.param.grad is None:
                if not torch.count_nonzero(mean):   # the same test on every rank of the node: the mean is shared
                    continue
                e.param.grad = torch.empty_like(e.param)
            if compact and e.structured:
                sparsity.recover(mean, e.row_idx, e.col_idx, e.param.shape, out=e.param.grad, plan=e.plan)
            else:
                e.param.grad.copy_(mean.view_as(e.param))

    @property
    def _retraining_masked(self) -> bool:
        """θ is held on the frozen structure (the retraining phase, after the freeze): its pruned entries stay 0."""
        return self.frozen and bool(self.structured)

    def add_proximal_grad(self, grads_on_structure: bool = False) -> None:
        """grad += ρ1(θ − z_i + u): the gradient of the intra-node penalty (Eq. 8). Once frozen the result is
        masked to the structure, a pass over every structured gradient; ``grads_on_structure`` says the gradients
        are zero outside it already (``node_sync``'s compact average, recovered in this very step, as
        :meth:`prunex_hvd.DistributedOptimizer.step` does), and with θ on it (``compact_compute`` on) the pass is
        skipped: every term is zero there."""
        for rho1, ks in self._prox_groups:
            live = [k for k in ks if self.entries[k].param.grad is not None]
            if not live:
                continue
            grads = [self.entries[k].param.grad for k in live]
            thetas = [self.entries[k].param.detach() for k in live]
            if self.state_dtype == self.dtype:
                torch._foreach_add_(grads, thetas, alpha=rho1)
                torch._foreach_add_(grads, [self._shift[k] for k in live])
            else:   # θ − (z_i − u) in float32 first: in half precision ρ1θ and ρ1(u − z_i) cancel badly
                prox = torch._foreach_sub(thetas, [self._shift[k] for k in live])
                torch._foreach_mul_(prox, rho1)
                torch._foreach_add_(grads, prox)
        if self._retraining_masked and not (grads_on_structure and self._computing_compact
                                            and self._layers_cover_structure and self._shift_on_structure
                                            and self.syncs_node_grads):
            torch._foreach_mul_([e.param.grad for e in self.structured if e.param.grad is not None],
                                [m for e, m in zip(self.structured, self._retrain_support())
                                 if e.param.grad is not None])

    def after_step(self) -> None:
        """Retraining phase (PruneX §4.5): once masks are frozen, θ stays on the frozen structure, so training
        is ordinary data-parallel training of the pruned model (momentum would move pruned entries). With
        ``overlap_steps``, the round in flight is folded in after that many steps (collective: every rank steps
        alike)."""
        if self._retraining_masked:
            with torch.no_grad():
                torch._foreach_mul_([e.param for e in self.structured], self._retrain_support())
            if not self._computing_compact:
                self._set_compact_compute(on_structure=True)
        f = self._in_flight
        if f is not None:
            f.steps_since += 1
            if f.steps_since == self.fold_after:
                self.complete()

    def _set_compact_compute(self, afresh: bool = False, on_structure: bool = False) -> None:
        """Each structured conv and linear multiplies only its kept block while θ is on the frozen structure
        (:mod:`prunex_hvd.engine.compact_compute`). Exact: θ is zero outside each block. Checked after every round
        (and fold), which can leave θ off it (``restart="none"`` at the freeze; an overlapped fold moving θ by
        z − θ_sent with a θ_sent from before the masking); the layers then multiply in full until the next step
        masks θ (:meth:`after_step`, ``on_structure``: no check needed). Plain layers before the freeze and after
        :meth:`finalize`. Decided from the engine's state and θ alone, so a resumed run switches where the
        uninterrupted one did (``afresh``: decided again, as by a new engine)."""
        if afresh:
            for _, layer in self._layers:
                compact_compute.compute_in_full(layer)
            self._computing_compact = False
        on = self._retraining_masked and not self.finalized
        if on and not on_structure:
            with torch.no_grad():
                on = all(torch.equal(sparsity.apply_masks(e.param, e.rows, e.cols), e.param) for e, _ in self._layers)
        if on == self._computing_compact:
            return
        for e, layer in self._layers:
            if on:
                compact_compute.compute_on_support(layer, e.rows, e.cols)
            else:
                compact_compute.compute_in_full(layer)
        self._computing_compact = on

    def _node_guard(self, where: float, steps: Optional[int]) -> None:
        """``node_sync``'s guard: a node's ranks talk every step, so a rank with one batch more than the others would
        pair its step's gradient average with their round's sum (a hang, or a transport error on some ranks).
        Before either, every rank writes where it is (in a step, at a round) and its step count into its slot of
        one small job-sized vector, summed over the node. Where no rank of the node is at a round that is all. At a
        round the leaders also sum it over the job (a leader still in a step whose node's others are at the round
        too: every leader sums once a round) and hand it to their node. Ranks not at the same point raise the same
        error, naming them: the other ranks of a node at fault as soon as they see it, everyone else from the job's
        sum. On the CPU, so a CUDA job does not wait on its device every step."""
        size, node_ranks = self.topo.size, self.topo.local_ranks
        cpu = self.groups.backend != "nccl"
        seen = torch.zeros(2 * size, dtype=torch.float64, device="cpu" if cpu else self.device)
        seen[self.topo.rank], seen[size + self.topo.rank] = where, -1 if steps is None else steps
        before = self.ledger.summary()
        with self.ledger.tagged("guard"):
            self.groups.intra.allreduce_(seen, "sum")
            node_ok = len({float(seen[r]) for r in node_ranks}) == 1 and \
                len({float(seen[size + r]) for r in node_ranks}) == 1
            at_round = any(float(seen[r]) == _AT_ROUND for r in node_ranks)
            if at_round and self.topo.num_nodes > 1:
                if not node_ok and not self.topo.is_leader:
                    raise RuntimeError(self._guard_message(seen))
                self._sum_up_the_tree(seen)
                if node_ok:
                    self.groups.intra.broadcast_(seen, root=0)
        self._count_traffic(before)
        if node_ok and not at_round:   # every rank of the node in this step
            return
        if node_ok and len(set(seen[:size].tolist())) == 1 and len(set(seen[size:].tolist())) == 1:
            return
        raise RuntimeError(self._guard_message(seen))

    def _sum_up_the_tree(self, tensor: torch.Tensor) -> None:
        """The node leaders' part of :meth:`_tree_` for a sum, without the last hand-down into the node: with racks
        over the rack, across the spine and back down the rack; else across the leaders."""
        if self.rack_tier:
            for comm in (self.groups.rack, self.groups.spine):
                if comm is not None:
                    comm.allreduce_(tensor, "sum")
            if self.groups.rack is not None:
                self.groups.rack.broadcast_(tensor, root=0)
        elif self.groups.inter is not None:
            self.groups.inter.allreduce_(tensor, "sum")

    def _guard_message(self, seen: torch.Tensor) -> str:
        size = self.topo.size
        ranks = [r for r in range(size) if seen[r] != 0]   # the slots filled: the node's, or the job's
        where = {r: ("in a local step" if float(seen[r]) == _IN_STEP else f"at consensus round {self.round + 1}")
                 + (f" after {int(seen[size + r])} steps" if seen[size + r] >= 0 else "") for r in ranks}
        groups: Dict[str, List[int]] = {}
        for r in ranks:
            groups.setdefault(where[r], []).append(r)
        said = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)} {w}" for w, rs in groups.items())
        return (f"node_sync: the ranks are not at the same point ({said}). Every rank must take the same number of "
                f"optimizer steps between rounds (equal data shards, drop the last partial batch): the ranks of a "
                f"node average their gradients every step, so one more step on one rank would meet its node's round")

    def _retrain_support(self) -> List[torch.Tensor]:
        if self._support is None:
            self._support = [sparsity.apply_masks(torch.ones_like(e.param), e.rows, e.cols) for e in self.structured]
        return self._support

    # -- the round ---------------------------------------------------------------------------------------
    def consensus_round(self, steps: Optional[int] = None) -> dict:
        """One round (collective). ``steps``: the optimizer steps this rank has taken, compared across ranks in
        the round's residual sum (ranks at different step counts raise on every rank instead of averaging models
        of different ages, or deadlocking at the end when one rank runs out of rounds first). Watched: a rank
        that never arrives stops the job, named (:mod:`prunex_hvd.dist.watchdog`)."""
        if self.finalized:
            raise RuntimeError("consensus round after finalize(): finalize() ends training (the model now holds "
                               "the consensus z); to evaluate the consensus mid-run use consensus_weights()")
        with watchdog.waiting(f"consensus round {self.round + 1}", world=True):
            if self.syncs_node_grads:
                self._node_guard(_AT_ROUND, steps)
            if self.overlapping:
                return self._overlapped_round(steps)
            return self._round(steps)

    @property
    def overlapping(self) -> bool:
        """Whether rounds are overlapped now: with ``overlap``, once the masks are frozen (before, each node's θ is
        far from the consensus and steps taken from it are worth little once rebased onto z; docs/algorithm.md,
        "Overlapped rounds")."""
        return self.overlap and self.frozen

    def _round(self, steps: Optional[int]) -> dict:
        """Algorithm 1 as its phases (numbered as in the module docstring and docs/algorithm.md)."""
        t0, before = time.perf_counter(), self.ledger.summary(by_op=False)
        nonfinite, z_i_new, masks_before, layout = self._start()   # 1–4 up to the exchange
        t_wire = time.perf_counter()
        w_new = None
        if self.rack_tier:                            # 4. with racks: rack sum, rack candidate, spine average
            w_new = self._rack_exchange(layout)
        else:
            with self.ledger.tagged("consensus"):     # 4. compact exchange among leaders, broadcast to the node
                for buf in layout.buffers:
                    self.groups.leaders_then_node_(buf, "avg", self.topo.num_nodes)
        wait = time.perf_counter() - t_wire
        self._settle(z_i_new, layout, nonfinite, steps, self._theta_sq(z_i_new), masks_before, w_new=w_new)   # 5–9
        self._restart()                               # 10. θ at the consensus
        self._set_compact_compute()
        return self._report(before, time.perf_counter() - t0, layout.total_numel, wait)

    def _start(self) -> tuple:
        """Phases 1–4 up to the exchange: (this rank's inf/NaN flags, the new z_i, the masks to put back if the
        round is refused, the compact buckets filled)."""
        nonfinite = self._intra_sum()                 # 1. intra-node sum of θ + u and the float buffers
        z_i_new = self._node_candidates()             # 2. node candidate z̃_i
        masks_before = self._mask_state()             #    (put back if the round is refused at 6)
        self._project(z_i_new)                        # 3. projection Π_S and the leaders' mask OR
        return nonfinite, z_i_new, masks_before, self._fill_compact(z_i_new)   # 4. the compact payload

    def _settle(self, z_i_new, layout, nonfinite, steps, theta_sq, masks_before, du=None,
                own_buffers: bool = False, w_new: Optional[List[torch.Tensor]] = None) -> None:
        """Phases 5–9 once the exchange has arrived in ``layout`` (``du``, ``own_buffers``: see
        :meth:`_update_duals`; ``w_new``: the racks' new w_r); a refused round puts the masks back and raises.
        With ``du`` (overlap) the proximal cache already holds this round's u and z_i, and is kept unless ρ1 moved."""
        z_new = self._recover(layout)                 # 5. recovery of z
        try:                                          # 6. verdict, from the job-wide residual sum
            totals, s_top_sq = self._verdict(z_i_new, z_new, nonfinite, steps, theta_sq, w_new)
        except BaseException:
            self._restore_mask_state(masks_before)
            raise
        self._update_duals(z_i_new, z_new, layout, du=du, own_buffers=own_buffers, w_new=w_new)   # 7. duals
        rho1_before = [e.rho1 for e in self.entries]
        self._adapt_rho(totals, s_top_sq)             # 8. residuals and adaptive ρ
        if du is None or rho1_before != [e.rho1 for e in self.entries]:
            self._refresh_prox()
        self.round += 1
        self._maybe_freeze()                          # 9. freezing

    # -- the overlapped round (docs/algorithm.md, "Overlapped rounds") ------------------------------------
    def _overlapped_round(self, steps: Optional[int]) -> dict:
        """``overlap``: fold in the round in flight if no step did (phases 5–10), then run this round's phases
        1–4 and leave its inter-node exchange in flight while the next local steps run, from θ as sent; after
        ``fold_after`` of them the fold rebases them on the consensus. Only those steps see stale values: the
        point they start from and ρ1 (the previous round's)."""
        t0, before = time.perf_counter(), self.ledger.summary(by_op=False)
        wait = self._fold() if self._in_flight is not None else 0.0
        nonfinite, z_i_new, masks_before, layout = self._start()   # 1–4 (the mask OR blocks; it is small)
        du = [e.param.detach().sub(z) for e, z in zip(self.entries, z_i_new)]   # u's step, θ as sent
        theta_sq = [admm.sq_norm(d) for d in du]
        with self.ledger.tagged("consensus"):         # 4. the exchange starts; the node goes on stepping
            works = [self.groups.inter.allreduce_async_(buf, "avg") for buf in layout.buffers] \
                if self.groups.inter is not None else []
        self._in_flight = _InFlight(steps=steps, nonfinite=nonfinite, z_i=z_i_new, du=du,
                                    theta_sq=theta_sq, masks_before=masks_before, layout=layout,
                                    works=works, pending_ef=self._pending_ef,
                                    theta_sent=[e.param.detach().clone() for e in self.entries]
                                    if self.config.restart != "none" else None)
        self._pending_ef = None
        self._refresh_prox()                          # the local steps pull toward this round's z_i already
        return self._report(before, time.perf_counter() - t0, layout.total_numel, wait)

    def _receive(self) -> float:
        """The round in flight's exchange completes: the leaders wait for it, then hand it to their node.
        Returns the seconds this rank waited (the exposed part of the exchange)."""
        f = self._in_flight
        if f.received:
            return 0.0
        t0 = time.perf_counter()
        with self.ledger.tagged("consensus"):
            for work in f.works:
                work.wait()
            for buf in f.layout.buffers:
                self.groups.intra.broadcast_(buf, root=0)
        f.received, f.works = True, []
        return time.perf_counter() - t0

    def _fold(self) -> float:
        """Phases 5–10 of the round in flight, as the blocking round runs them (the duals from θ as the round
        sent it); θ, which went on stepping from where it was sent, moves by z − θ_sent (``restart="global"``):
        the restart, with the steps taken since kept on top."""
        f = self._in_flight
        wait = self._receive()
        self._in_flight, self._pending_ef = None, f.pending_ef
        try:                                          # 5–9 (a rank's own buffers follow its steps)
            self._settle(f.z_i, f.layout, f.nonfinite, f.steps, f.theta_sq, f.masks_before, du=f.du,
                         own_buffers=True)
        except BaseException:   # refused: the committed state is the previous round's, so is the prox cache
            self._refresh_prox()
            raise
        if f.theta_sent is not None:                  # 10. restart, late: θ += z − θ_sent
            with torch.no_grad():
                for e, sent in zip(self.entries, f.theta_sent):
                    e.param.add_(sent.neg_().add_(e.z.to(e.param.dtype)))   # θ_sent is not needed again
        self._set_compact_compute()
        return wait

    def complete(self) -> None:
        """Fold in the round in flight now (``overlap``; collective: every rank calls it), so the engine's z,
        duals and ρ are those of every round run so far. Nothing to do without overlap or between rounds.
        :meth:`finalize` calls it; a training loop need not (the next round folds it in)."""
        if self._in_flight is not None:
            with watchdog.waiting(f"consensus round {self.round + 1} (completing)", world=True):
                before = self.ledger.summary()
                self.exchange_wait_s += self._fold()
                self._count_traffic(before)

    # -- the round's phases ------------------------------------------------------------------------------
    def _intra_sum(self) -> List[bool]:
        """Phase 1: θ + u (and the float buffers) into the dense buckets, summed over the node. Returns this
        rank's own inf/NaN flags, looked for before the sum mixes them in (or a pruned entry hides them)."""
        n = len(self.entries)
        for k, e in enumerate(self.entries):
            if self.state_dtype == self.dtype:
                torch.add(e.param.detach().reshape(-1), e.u.reshape(-1), out=self._dense.views[k])
            else:   # added in float32, rounded once to the payload
                self._dense.views[k].copy_(e.param.detach().reshape(-1)).add_(e.u.reshape(-1))
        for j, (_, b) in enumerate(self.buffers):
            self._dense.views[n + j].copy_(b.reshape(-1))
        nonfinite = self._nonfinite()
        with self.ledger.tagged("intra-sum"):
            for buf in self._dense.buffers:
                self.groups.intra.allreduce_(buf, "sum")
        return nonfinite

    def _node_candidates(self) -> List[torch.Tensor]:
        """Phase 2: the exact argmin in z_i of every entry (every rank of the node computes the same); with racks
        z_i's consensus above it is its rack's w_r, not z."""
        P = self.topo.local_size
        return [admm.node_candidate(self._dense.views[k].view_as(e.z), e.w if self.rack_tier else e.z, e.v,
                                    e.rho1, e.rho2, P)
                for k, e in enumerate(self.entries)]

    def _project(self, z_i_new: List[torch.Tensor]) -> None:
        """Phase 3, in place on the structured candidates: Π_S and the global masks (leaders OR them); once
        frozen, the frozen masks alone."""
        structured_ks = [k for k, e in enumerate(self.entries) if e.structured]
        if not self.frozen:
            local = self._masks({self.entries[k].name: z_i_new[k] for k in structured_ks})
            for k, (rows, cols) in zip(structured_ks, local):
                z_i_new[k] = sparsity.apply_masks(z_i_new[k], rows, cols)
            self._sync_masks(local)
        else:
            self.mask_drift = 0.0
            for k in structured_ks:
                z_i_new[k] = sparsity.apply_masks(z_i_new[k], self.entries[k].rows, self.entries[k].cols)

    def _fill_compact(self, z_i_new: List[torch.Tensor]) -> BucketLayout:
        """Phase 4's payload: leaders shrink z_i + v_i onto the global support into the compact buckets (which
        the round then averages across nodes and hands to each node). One node: z = z_i + v, every rank has
        it, nothing to exchange. A narrow payload (``delta_coded``) carries z_i + v_i − z + e instead (with racks
        − w_r), rounded; e, the rounding error, is sent again next round (error feedback), and z is recovered
        as z + the average."""
        n, P = len(self.entries), self.topo.local_size
        layout = self._compact_layout()
        self._pending_ef = []
        if self.topo.is_leader or not self.inter_tier:
            for k, e in enumerate(self.entries):
                c = z_i_new[k] + e.v
                if self.delta_coded:   # one pass
                    c = self._delta(c, e.w if self.rack_tier else e.z, e.ef, e, self._pending_ef)
                else:
                    c = c.to(self.payload_dtype)
                if e.structured:
                    sparsity.shrink_into(c, e.row_idx, e.col_idx, layout.views[k], plan=e.plan)
                else:
                    layout.views[k].copy_(c.reshape(-1))
            for j, (_, b) in enumerate(self.buffers):
                mean = self._dense.views[n + j].view_as(b) / P
                if self.delta_coded:
                    mean = self._delta(mean.to(self.state_dtype), self._round_buffers[j].to(self.state_dtype),
                                       self._buffer_ef[j], None, self._pending_ef)
                layout.views[n + j].copy_(mean.reshape(-1))
        return layout

    def _rack_exchange(self, layout: BucketLayout) -> List[torch.Tensor]:
        """Phase 4 with racks (docs/algorithm.md, "A third tier: racks"), on the compact buckets the node leaders
        filled with z_i + v_i: (a) the node leaders of each rack sum them over the rack's switch and hand the sum
        to their node; (b) every rank forms its rack's candidate w_r from it, on the global support; (c) the rack
        leaders average w_r + t_r across the spine, in the same buckets (the sum has been read), and the average
        goes back down the rack and the node. The float buffers ride along: each rack's mean of its nodes'
        means, then the mean over racks. A narrow payload carries changes at both levels, each with its own
        error feedback: z_i + v_i − w_r + e_i into the rack, w_r + t_r − z + f_r across the spine. Returns the
        new w_r; ``layout`` then holds z's payload."""
        N, n = self.topo.nodes_per_rack, len(self.entries)
        self._pending_ef_spine = []
        with self.ledger.tagged("consensus"):         # (a) Σ_{i∈r}(z_i + v_i), compact
            for buf in layout.buffers:
                if self.groups.rack is not None:
                    self.groups.rack.allreduce_(buf, "sum")
                self.groups.intra.broadcast_(buf, root=0)
        w_new = []                                    # (b) the rack candidate, the same on every rank of the rack
        sums = self._recover(layout, [e.w * N for e in self.entries] if self.delta_coded else None)
        for e, rack_sum in zip(self.entries, sums):
            w = admm.rack_candidate(rack_sum, e.z, e.t, e.rho2, e.rho3, N)
            w_new.append(sparsity.apply_masks(w, e.rows, e.cols) if e.structured else w)
        if self.topo.is_rack_leader:                  # (c) w_r + t_r across the spine, compact
            for k, e in enumerate(self.entries):
                c = w_new[k] + e.t
                c = self._delta(c, e.z, e.ef_spine, e, self._pending_ef_spine) if self.delta_coded \
                    else c.to(self.payload_dtype)
                if e.structured:
                    sparsity.shrink_into(c, e.row_idx, e.col_idx, layout.views[k], plan=e.plan)
                else:
                    layout.views[k].copy_(c.reshape(-1))
        for j in range(len(self.buffers)):            # the rack's mean (of the nodes' changes, narrow)
            if not self.delta_coded:
                layout.views[n + j].div_(N)
            elif self.topo.is_rack_leader:
                layout.views[n + j].copy_(self._delta(layout.views[n + j].to(self.state_dtype).div_(N), 0.0,
                                                      self._buffer_ef_spine[j], None, self._pending_ef_spine))
        with self.ledger.tagged("consensus"):
            for buf in layout.buffers:
                if self.groups.spine is not None:
                    self.groups.spine.allreduce_(buf, "avg")
                if self.groups.rack is not None:
                    self.groups.rack.broadcast_(buf, root=0)
                self.groups.intra.broadcast_(buf, root=0)
        return w_new

    def _delta(self, target: torch.Tensor, z, ef: torch.Tensor, e: Optional[Entry], pending: list) -> torch.Tensor:
        """What a narrow payload carries for one tensor: q = round(target − z + ef) in the payload's dtype. The
        new error target − z + ef − q (on the global support: pruned entries are dropped, as z's are) waits in
        ``pending`` until the round is accepted."""
        delta = target.sub_(z).add_(ef)   # ``target`` is the caller's own temporary
        q = delta.to(self.payload_dtype)
        error = delta.sub_(q)
        if e is not None and e.structured:
            error = sparsity.apply_masks(error, e.rows, e.cols)
        pending.append(error)
        return q

    def _recover(self, layout: BucketLayout, bases: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
        """Phase 5: z of every entry from the compact buckets (one pass per layer), in the state's dtype
        (a narrow payload's average is the change: added to the last z, cut to the new support; ``bases``: what
        it is the change of, in place of z)."""
        z_new = []
        for k, e in enumerate(self.entries):
            if k in self._gathers:   # one gather of whole chunks from the bucket (see _compact_layout)
                z = sparsity.recover_gather(*self._gathers[k], e.z.shape)
            elif e.structured:
                z = sparsity.recover(layout.views[k], e.row_idx, e.col_idx, e.z.shape, plan=e.plan)
            else:
                z = layout.views[k].view_as(e.z).clone()
            z = z.to(self.state_dtype)
            if self.delta_coded:
                base = e.z if bases is None else bases[k]
                z += sparsity.apply_masks(base, e.rows, e.cols) if e.structured else base
            z_new.append(z)
        return z_new

    def _theta_sq(self, z_i_new) -> List[torch.Tensor]:
        """‖θ − z_i‖² per entry (r_intra's terms), θ as this round sees it."""
        return [admm.sq_norm(e.param.detach() - z) for e, z in zip(self.entries, z_i_new)]

    def _verdict(self, z_i_new, z_new, nonfinite: List[bool], steps: Optional[int], theta_sq: List[torch.Tensor],
                 w_new: Optional[List[torch.Tensor]] = None):
        """Phase 6, the safety protocol: the residuals' job-wide sum also carries every rank's round, step count
        and inf/NaN flags (no extra collective), so every rank takes the same verdict before any state changes
        (:meth:`_check_round` raises). Returns the summed residual squares per entry (r_intra², s_intra²,
        r_inter²; with racks then s_inter², r_spine²) and the top tier's s² per entry (from z: the same
        everywhere)."""
        P, M, n = self.topo.local_size, self.topo.num_nodes, len(self.entries)
        width = 3 if w_new is None else 5
        local_sq = torch.zeros(n, width, dtype=torch.float64, device=self.device)   # on the device: no sync per layer
        s_inter_sq = torch.zeros(n, dtype=torch.float64, device=self.device)
        for k, e in enumerate(self.entries):
            local_sq[k, 0] = theta_sq[k]
            upper = z_new[k] if w_new is None else w_new[k]   # the consensus z_i answers to
            if self.topo.is_leader:   # node-level terms: once per node, the dual one for the node's P copies
                local_sq[k, 1] = admm.dual_residual_sq(admm.sq_norm(z_i_new[k] - e.z_i), e.rho1, P)
                local_sq[k, 2] = admm.sq_norm(z_i_new[k] - upper)
            if w_new is None:
                s_inter_sq[k] = admm.dual_residual_sq(admm.sq_norm(z_new[k] - e.z), e.rho2, M)   # M copies of z
                continue
            if self.topo.is_rack_leader:   # rack-level terms: once per rack, the dual one for its N copies
                local_sq[k, 3] = admm.dual_residual_sq(admm.sq_norm(w_new[k] - e.w), e.rho2, self.topo.nodes_per_rack)
                local_sq[k, 4] = admm.sq_norm(w_new[k] - z_new[k])
            s_inter_sq[k] = admm.dual_residual_sq(admm.sq_norm(z_new[k] - e.z), e.rho3, self.topo.num_racks)
        size = self.topo.size
        who = self._who(steps, nonfinite)
        where = torch.tensor(nonfinite, dtype=torch.float64)    # per entry, then the float buffers
        summed = self._sum_over_job(torch.cat([local_sq.reshape(-1), who.reshape(-1).to(self.device),
                                               where.to(self.device)]))
        s_inter_sq = s_inter_sq.tolist()   # from the global z: the same on every rank, read once
        totals = summed[:width * n].view(n, width)
        try:
            self._check_round(summed[width * n: width * n + 3 * size].view(-1, 3), summed[width * n + 3 * size:],
                              totals, s_inter_sq)
        except (RuntimeError, FloatingPointError) as exc:   # refused, on every rank alike
            if self.topo.rank == 0:   # the raised error says why; the log marks where in the run
                log.error("round %d refused (%s): every rank keeps the state of round %d",
                          self.round + 1, type(exc).__name__, self.round)
            raise
        return totals, s_inter_sq

    def _update_duals(self, z_i_new, z_new, layout: BucketLayout, du: Optional[List[torch.Tensor]] = None,
                      own_buffers: bool = False, w_new: Optional[List[torch.Tensor]] = None) -> None:
        """Phase 7: v_i += z_i − z, u += θ − z_i (``du``: that step, formed when θ was sent); with racks
        v_i += z_i − w_r and t_r += w_r − z; the new z_i (w_r) and z; the float buffers averaged in the round,
        kept (with z they are the consensus model) and taken by every rank, unless ``own_buffers`` (overlap: a
        rank's running statistics have followed its steps since it sent them, and keep doing so)."""
        for k, e in enumerate(self.entries):
            admm.update_dual(e.v, z_i_new[k], z_new[k] if w_new is None else w_new[k])
            if du is None:
                admm.update_dual(e.u, e.param.detach(), z_i_new[k])
            else:
                e.u.add_(du[k])
            if w_new is not None:
                admm.update_dual(e.t, w_new[k], z_new[k])
            if w_new is not None:
                e.w = w_new[k]
            e.z_i, e.z = z_i_new[k], z_new[k]
        n = len(self.entries)
        for j, (_, b) in enumerate(self.buffers):
            avg = layout.views[n + j].view_as(b)
            if self.delta_coded:   # the change of the averaged buffers
                avg = (self._round_buffers[j].to(self.state_dtype) + avg.to(self.state_dtype)).to(b.dtype)
            self._round_buffers[j].copy_(avg)
            if not own_buffers:
                b.copy_(avg)
        if self.delta_coded and self._pending_ef:   # leaders: the errors of this round's rounding
            for ef, new in zip([e.ef for e in self.entries] + self._buffer_ef, self._pending_ef):
                ef.copy_(new)
        if self.delta_coded and self._pending_ef_spine:   # rack leaders: the spine's
            for ef, new in zip([e.ef_spine for e in self.entries] + self._buffer_ef_spine, self._pending_ef_spine):
                ef.copy_(new)
        self._pending_ef = self._pending_ef_spine = None

    def _adapt_rho(self, totals: torch.Tensor, s_top_sq: List[float]) -> None:
        """Phase 8: per-layer residuals; with ``adaptive_rho``, residual balancing of ρ1 (and of ρ2 where there is an
        inter-node tier, ρ3 where there are racks), the scaled duals rescaled with them (the caller refreshes the
        proximal cache)."""
        changed = []
        c = self.config
        for k, e in enumerate(self.entries):
            # with racks ρ2's tier is nodes against their rack, then ρ3's racks against z (r_spine, s_spine)
            r_intra, s_intra, r_inter, s_inter, *spine = admm.residual_norms(*totals[k].tolist(), s_top_sq[k])
            r_spine, s_spine = spine or (0.0, 0.0)
            e.residuals = {"r_intra": r_intra, "s_intra": s_intra}
            if self.inter_tier:
                e.residuals.update(r_inter=r_inter, s_inter=s_inter)
            if self.rack_tier:
                e.residuals.update(r_spine=r_spine, s_spine=s_spine)
            if not c.adaptive_rho:
                continue
            rho1 = admm.adapt_rho(e.rho1, r_intra, s_intra, c.rho_max)
            rho2 = admm.adapt_rho(e.rho2, r_inter, s_inter, c.rho_max) if self.inter_tier else e.rho2
            rho3 = admm.adapt_rho(e.rho3, r_spine, s_spine, c.rho_max) if self.rack_tier else e.rho3
            changed += [f"{e.name} {which} {old:.3g}->{new:.3g}" for which, old, new in
                        (("rho1", e.rho1, rho1), ("rho2", e.rho2, rho2), ("rho3", e.rho3, rho3)) if new != old]
            admm.rescale_dual(e.u, e.rho1, rho1)
            admm.rescale_dual(e.v, e.rho2, rho2)
            if self.rack_tier:
                admm.rescale_dual(e.t, e.rho3, rho3)
            e.rho1, e.rho2, e.rho3 = rho1, rho2, rho3
        if changed and self.topo.rank == 0:
            shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
            log.info("round %d: rho changed %d time(s): %s", self.round + 1, len(changed), shown)

    def _maybe_freeze(self) -> None:
        """Phase 9: freeze after ``freeze_round`` rounds or ``freeze_patience`` rounds without a mask change."""
        if not self.frozen:
            self.stable_rounds = self.stable_rounds + 1 if self.mask_drift == 0 else 0
            if (self.config.freeze_round is not None and self.round >= self.config.freeze_round) \
                    or self.stable_rounds >= self.config.freeze_patience:
                self._freeze()

    def _restart(self) -> None:
        """Phase 10 (``restart="global"``): θ of every rank starts the next round's local steps at the consensus z,
        as local SGD restarts from the average. Only where the θ-step's inexact solve begins changes: its
        objective f(θ) + ρ1/2‖θ − z_i + u‖², and so u, keep their meaning. Once frozen, z is on the structure, so θ
        is too."""
        if self.config.restart == "none":
            return
        with torch.no_grad():
            for e in self.entries:
                e.param.copy_(e.z)

    def _freeze(self, refresh: bool = True) -> None:
        """Masks stop moving. The OR of the nodes' masks may keep more than was asked, so the frozen structure
        is the requested one, cut from the global z (the same on every rank): the retraining phase then trains
        exactly the model that :meth:`finalize` returns. ``refresh=False``: the caller moves z_i next and
        refreshes the proximal cache itself."""
        for e, (rows, cols) in zip(self.structured, self._masks({e.name: e.z for e in self.structured})):
            e.set_masks(rows, cols)
            e.z = sparsity.apply_masks(e.z, e.rows, e.cols)
            if e.w is not None:   # the racks' consensus too: every tier above the nodes on the frozen structure
                e.w = sparsity.apply_masks(e.w, e.rows, e.cols)
        self._compact = self._support = self._grads = None
        self.frozen = True
        if refresh:
            self._refresh_prox()   # the shift cut to the structure
        if self.topo.rank == 0:
            when = f"round {self.round}: masks frozen" if self.round else \
                "masks chosen from the start weights and frozen before the first step (freeze_round=0)"
            log.info("%s, density %.3f of the structured weights", when, self.density())

    def _freeze_at_start(self) -> None:
        """``freeze_round=0``: the masks are Π_S's support on the start point θ0, the same on every rank after the
        broadcast (so chosen with no collective), frozen before any step; z = z_i = θ = Π_S(θ0), the duals at 0, ρ
        as configured. The rounds are then those after a freeze from the first (docs/algorithm.md, "Masks chosen
        at the start")."""
        self._freeze(refresh=False)
        with torch.no_grad():
            for e in self.structured:
                e.z_i = e.z.clone()
                e.param.copy_(e.z)
        self._refresh_prox()
        self._set_compact_compute()

    # -- helpers -----------------------------------------------------------------------------------------
    def _nonfinite(self) -> List[bool]:
        """Per entry (then one for all float buffers): does this rank's θ + u (the dense views before the intra
        sum) hold inf or NaN? One check per bucket when all is well."""
        n = len(self.entries)
        views = self._dense.views
        if all(bool(torch.isfinite(b).all()) for b in self._dense.buffers):
            return [False] * (n + 1)
        return [not bool(torch.isfinite(views[k]).all()) for k in range(n)] + \
            [any(not bool(torch.isfinite(v).all()) for v in views[n:])]

    def _who(self, steps: Optional[int], nonfinite: List[bool]) -> torch.Tensor:
        """This rank's row of the round's check (round, step count, any inf/NaN), in a table of one row per rank:
        summed over the job, every row is filled (:meth:`_check_round` reads it)."""
        who = torch.zeros(self.topo.size, 3, dtype=torch.float64)
        who[self.topo.rank] = torch.tensor([self.round + 1, -1 if steps is None else steps, float(any(nonfinite))])
        return who

    def _check_round(self, who: torch.Tensor, where: torch.Tensor, totals: torch.Tensor,
                     s_inter_sq: List[float]) -> None:
        """Refuse the round, on every rank alike, if the ranks were not at the same round and step count, or if
        inf/NaN showed up anywhere. Every input is the same on every rank (job-wide sums, and s_inter from the
        global z), so is the verdict. Raised before any state is updated: the engine (and the last checkpoint)
        stay at the previous round."""
        def by_value(column: torch.Tensor) -> str:
            groups: Dict[int, List[int]] = {}
            for r, v in enumerate(column.tolist()):
                groups.setdefault(int(v), []).append(r)
            return "; ".join(f"{v} on rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}" for v, rs in sorted(groups.items()))
        if len(set(who[:, 0].tolist())) > 1:
            raise RuntimeError(f"consensus round: the ranks are in different rounds ({by_value(who[:, 0])}); "
                               f"every rank must run every round, and resume from the same checkpoint")
        if min(who[:, 1].tolist()) >= 0 and len(set(who[:, 1].tolist())) > 1:
            raise RuntimeError(
                f"consensus round {self.round + 1}: the ranks took different numbers of optimizer steps "
                f"({by_value(who[:, 1])}). Every rank must step as often between rounds (equal data shards, drop "
                f"the last partial batch), else a round averages models of different ages and the last rounds "
                f"cannot line up")
        n = len(self.entries)
        bad_ranks = [r for r, flag in enumerate(who[:, 2].tolist()) if flag]
        bad = ["the float buffers (BatchNorm running statistics)"] if where[n] else []
        bad += [self.entries[k].name for k in range(n)
                if where[k] or not (bool(torch.isfinite(totals[k]).all()) and math.isfinite(s_inter_sq[k]))]
        if bad or bad_ranks:
            shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            source = (f"θ + u of rank{'s' if len(bad_ranks) > 1 else ''} {_ranks(bad_ranks)}" if bad_ranks
                      else "the consensus (it overflowed from finite inputs"
                      + ("; payload_dtype='fp16' holds changes up to 65504 only: use 'bf16'"
                         if self.payload_dtype == torch.float16 and self.delta_coded else "") + ")")
            if bad_ranks and self.config.node_sync and self.topo.local_size > 1:
                source += (" (node_sync: the ranks of a node average their gradients, so one rank's bad batch "
                           "reaches every rank of its node)")
            raise FloatingPointError(
                f"consensus round {self.round + 1}: inf or NaN in {shown or 'the model'}, from {source}. Every "
                f"rank stops here with the state of round {self.round}: lower the learning rate or rho, check "
                f"the data, and resume from the last checkpoint")

    def _mask_state(self):
        return ([(e.rows, e.cols, e.row_idx, e.col_idx, e.plan) for e in self.structured], self.mask_drift,
                self._compact)

    def _restore_mask_state(self, saved) -> None:
        masks, self.mask_drift, self._compact = saved
        for e, (rows, cols, row_idx, col_idx, plan) in zip(self.structured, masks):
            e.rows, e.cols, e.row_idx, e.col_idx, e.plan = rows, cols, row_idx, col_idx, plan

    def _masks(self, weights: Dict[str, torch.Tensor]) -> List[tuple]:
        """Π_S's support for every structured entry (in ``self.structured`` order), coupled channel groups
        (pairs, residual streams) pruned together, the channels of ``budget_layers`` from one budget across them
        (``channel_budget="global"``)."""
        specs = {e.name: e.spec for e in self.structured}
        channels = sparsity.budget_channels(weights, {n: specs[n] for n in self.budget_layers}) \
            if self.budget_layers else None
        masks = sparsity.coupled_masks(weights, specs, self.couplings, self.streams, self.heads, channels)
        return [masks[e.name] for e in self.structured]

    def _sync_masks(self, local) -> None:
        """OR every node's row/col masks among the leaders, then hand the result to the node."""
        if not self.structured:
            self.mask_drift = 0.0
            return
        flat = torch.cat([torch.cat([r, c]) for r, c in local]).to(torch.uint8)
        with self.ledger.tagged("masks"):   # one node: every rank projected the same z_i already
            self._tree_(flat, "bor")
        flat = flat.bool()
        changed = kept_total = 0
        offset = 0
        for e in self.structured:
            nr, nc = len(e.rows), len(e.cols)
            rows, cols = flat[offset: offset + nr], flat[offset + nr: offset + nr + nc]
            offset += nr + nc
            both = int((rows & e.rows).sum()) * int((cols & e.cols).sum())
            changed += int(rows.sum()) * int(cols.sum()) + int(e.rows.sum()) * int(e.cols.sum()) - 2 * both
            kept_total += nr * nc
            e.set_masks(rows, cols)
        self.mask_drift = changed / kept_total
        if changed:
            self._compact = None   # the compact shapes changed: new buckets

    def _layout(self, param_numels, zero_tail: int = 0, dtype: Optional[torch.dtype] = None) -> BucketLayout:
        """Buckets for one number per parameter, then the float buffers (always dense), in ``dtype`` (the
        model's by default)."""
        return BucketLayout(list(param_numels) + [b.numel() for _, b in self.buffers], dtype or self.dtype,
                            self.device, self.bucket_bytes, zero_tail=zero_tail)

    def _compact_layout(self) -> BucketLayout:
        """The compact buckets, made again whenever the masks change. Layers with a gather plan (CUDA; CPU
        without the native kernel) recover z by one gather from their bucket slice, pruned chunks reading a zero
        row kept past each bucket's end (never sent): z is written once, not zero-filled and then scattered.
        (On CPU the kernel's plan does the same in one pass.)"""
        if self._compact is None:
            tail = 2 * max((e.plan.chunk for e in self.structured if isinstance(e.plan, sparsity.GatherPlan)),
                           default=0)
            self._compact = self._layout((e.compact_numel() for e in self.entries), zero_tail=tail,
                                         dtype=self.payload_dtype)
        if self._gathers_of is not self._compact:   # a new layout, or one restored with its masks
            self._gathers, self._gathers_of = {}, self._compact
            for k, e in enumerate(self.entries):
                if e.structured and isinstance(e.plan, sparsity.GatherPlan):
                    rows, zero_row = self._compact.chunk_rows(k, e.plan.chunk)
                    self._gathers[k] = (rows, e.plan.slot.masked_fill(e.plan.slot < 0, zero_row))
        return self._compact

    def _sum_over_job(self, local: torch.Tensor) -> torch.Tensor:
        """Sum a small float64 tensor over every rank, hierarchically (non-leaders never cross nodes). It
        travels on the model's device, so a CUDA model's round stays on NCCL."""
        local = local.to(self.device)
        with self.ledger.tagged("residuals"):
            self.groups.intra.allreduce_(local, "sum")
            self._tree_(local, "sum")
        return local.cpu()

    def _count_traffic(self, before: dict) -> tuple:
        """The bytes put on the wire since ``before`` (a ledger summary), added to ``self.bytes``: what crossed
        node boundaries (``inter``), the rest (``intra``), and the part of ``inter`` that crossed racks
        (``cross_rack``). Returns (inter, intra, cross_rack)."""
        after, before = self.ledger.summary()["total"], before["total"]
        cross = after["cross_node_bytes"] - before["cross_node_bytes"]
        intra = after["wire_bytes"] - before["wire_bytes"] - cross
        cross_rack = after["cross_rack_bytes"] - before["cross_rack_bytes"]
        self.bytes["inter"] += cross
        self.bytes["intra"] += intra
        self.bytes["cross_rack"] += cross_rack
        return cross, intra, cross_rack

    def _report(self, before, seconds, compact_numel: Optional[int], wait: float) -> dict:
        """Bytes of the round as the ring model puts them on the wire: ``inter`` = what crossed node
        boundaries, ``intra`` = the rest. The consensus exchange and its dense counterfactual are counted
        on the group that carries it (the leaders; the one group of a flat consensus), so their ratio is
        exact; a round of the synchronous phase exchanges no model (``compact_numel=None``: neither is counted)."""
        exchanged = compact_numel is not None
        cross, intra, cross_rack = self._count_traffic(before)
        if self.topo.num_nodes > 1:
            carrier = self.groups.inter       # None on non-leaders: they send nothing across
        else:                                 # flat: every rank's dense θ+u sum is the exchange
            carrier, compact_numel = self.groups.intra, self._dense.total_numel

        # with racks: the rack sum and the z's way down the rack (rack group), the spine's average
        hops = [(self.groups.rack, "allreduce"), (self.groups.spine, "allreduce"), (self.groups.rack, "broadcast")] \
            if self.rack_tier else [(carrier, "allreduce")]

        def on_carrier(numel: int, dtype: torch.dtype) -> int:
            total = 0
            for comm, op in hops:
                if comm is not None:
                    sizes = [numel * comm.wire_dtype(dtype).itemsize] * comm.size
                    total += ring_cross_node_bytes(op, sizes, comm.rank, comm.nodes)
            return total
        consensus = on_carrier(compact_numel, self.payload_dtype if self.topo.num_nodes > 1 else self.dtype) \
            if exchanged else 0
        dense = on_carrier(self._dense.total_numel, self.dtype) if exchanged else 0   # (in the model's dtype)
        self.bytes["inter_consensus"] += consensus
        self.bytes["dense_inter"] += dense
        self.exchange_wait_s += wait
        return {"round": self.round, "seconds": seconds, "exchange_wait_seconds": wait,
                "in_flight": self._in_flight is not None, "inter_bytes": cross, "intra_bytes": intra,
                "consensus_bytes": consensus, "dense_inter_bytes": dense, "cross_rack_bytes": cross_rack,
                "density": self.density(), "mask_drift": self.mask_drift, "frozen": self.frozen}

    def density(self) -> float:
        """Fraction of structured (conv) weights kept by the global masks."""
        kept = sum(int(e.rows.sum()) * int(e.cols.sum()) for e in self.structured)
        total = sum(e.param.numel() for e in self.structured)
        return kept / total if total else 1.0

    def layer_density(self) -> Dict[str, float]:
        return {e.name: sparsity.density(e.rows, e.cols) for e in self.structured}

    def finalize(self) -> None:
        """Write the consensus model into the model: the global z and the float buffers (BatchNorm running
        statistics) averaged in the last round, so every rank holds the same, exactly structurally sparse model
        (no communication; steps taken since the last round are not in it: run :meth:`consensus_round` first
        to include them). If nodes' masks still differed (their OR is larger than asked), z is projected onto
        the requested structure first, so the model is at the requested density. Training ends here: a later
        round raises (as the wrapped optimizer's ``step()`` does). A round in flight (``overlap``) is folded
        in first."""
        self.complete()
        with torch.no_grad():
            for e, (rows, cols) in zip(self.structured, self._masks({e.name: e.z for e in self.structured})):
                e.z.copy_(sparsity.apply_masks(e.z, rows, cols))
            self._write_consensus_model()
        self.finalized = True
        self._set_compact_compute()   # the user gets plain layers back

    @contextmanager
    def consensus_weights(self):
        """Put the consensus model (z and the last round's float buffers, as :meth:`finalize` writes them) into
        the model for the duration, to evaluate the pruned model mid-run, identical on every rank without any
        communication; θ and this rank's own buffers are restored after."""
        saved = [e.param.detach().clone() for e in self.entries]
        saved_buffers = [b.clone() for _, b in self.buffers]
        with torch.no_grad():
            self._write_consensus_model()
        try:
            yield
        finally:
            with torch.no_grad():
                for e, theta in zip(self.entries, saved):
                    e.param.copy_(theta)
                for (_, b), old in zip(self.buffers, saved_buffers):
                    b.copy_(old)

    def _write_consensus_model(self) -> None:
        for e in self.entries:
            e.param.copy_(e.z)
        for (_, b), avg in zip(self.buffers, self._round_buffers):
            b.copy_(avg)

    # -- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The engine's state, to resume bit for bit. A round in flight (``overlap``) is received first (the
        exchange completes; collective, as a checkpoint is) and recorded as it stands, to be folded in at the
        same point of the resumed run: taking a checkpoint does not change the run."""
        f = self._in_flight
        if f is not None:
            before = self.ledger.summary()
            self.exchange_wait_s += self._receive()
            self._count_traffic(before)
        sd = self._committed_state()
        if f is not None:
            names = [e.name for e in self.entries]
            sd["in_flight"] = {
                "steps": f.steps, "nonfinite": list(f.nonfinite),
                "z_i": dict(zip(names, (t.clone() for t in f.z_i))), "du": dict(zip(names, (t.clone() for t in f.du))),
                "theta_sq": torch.stack(f.theta_sq).cpu(), "payload": [b.clone() for b in f.layout.buffers],
                "masks_before": [(m[0].clone(), m[1].clone()) for m in f.masks_before[0]],
                "mask_drift_before": f.masks_before[1],
                "pending_ef": None if f.pending_ef is None else [t.clone() for t in f.pending_ef],
                "steps_since": f.steps_since,
                "theta_sent": None if f.theta_sent is None else dict(zip(names, (t.clone() for t in f.theta_sent)))}
        return sd

    def _committed_state(self) -> dict:
        return {
            "round": self.round, "frozen": self.frozen, "stable_rounds": self.stable_rounds,
            "mask_drift": self.mask_drift, "bytes": dict(self.bytes),
            "entries": {e.name: {"u": e.u.clone(), "z_i": e.z_i.clone(), "v": e.v.clone(), "z": e.z.clone(),
                                 "rho1": e.rho1, "rho2": e.rho2, "residuals": dict(e.residuals),
                                 "rows": None if e.rows is None else e.rows.clone(),
                                 "cols": None if e.cols is None else e.cols.clone(),
                                 "ef": None if e.ef is None else e.ef.clone(),
                                 **({"w": e.w.clone(), "t": e.t.clone(), "rho3": e.rho3,
                                     "ef_spine": None if e.ef_spine is None else e.ef_spine.clone()}
                                    if e.w is not None else {})}
                        for e in self.entries},
            "round_buffers": {name: b.clone() for (name, _), b in zip(self.buffers, self._round_buffers)},
            "buffer_ef": {name: ef.clone() for (name, _), ef in zip(self.buffers, self._buffer_ef)},
            "buffer_ef_spine": {name: ef.clone() for (name, _), ef in zip(self.buffers, self._buffer_ef_spine)},
        }

    def load_state_dict(self, sd: dict) -> None:
        names = [e.name for e in self.entries]
        removed = [what for what, saved in (("retrain='average'", sd.get("averaging")),
                                            ("sync_powersgd_rank", sd.get("sync_lowrank")),
                                            ("acceleration", any("z_hat" in s for s in sd["entries"].values())))
                   if saved]
        if removed:   # a checkpoint of an earlier version, in a mode it no longer has
            raise ValueError(f"engine state: saved with {', '.join(removed)}, which this version no longer has "
                             f"(benchmarks/log/removed-knobs.md): resume it with the version that saved it")
        if sorted(sd["entries"]) != sorted(names):
            missing = sorted(set(names) - set(sd["entries"]))
            extra = sorted(set(sd["entries"]) - set(names))
            raise ValueError(f"engine state does not fit this model: missing {missing[:5]}, unexpected {extra[:5]}")
        for e in self.entries:
            s = sd["entries"][e.name]
            if tuple(s["z"].shape) != tuple(e.z.shape):
                raise ValueError(f"engine state for {e.name} has shape {tuple(s['z'].shape)}, the model {tuple(e.z.shape)}")
            if ("w" in s) != self.rack_tier:
                raise ValueError(f"engine state: saved {'with' if 'w' in s else 'without'} the rack tier, resumed "
                                 f"{'with' if self.rack_tier else 'without'} it: resume on the same racks "
                                 f"(nodes_per_rack) and rack_tier setting")
            for key in ("u", "z_i", "v", "z") + (("w", "t") if self.rack_tier else ()):
                getattr(e, key).copy_(s[key])
            if self.rack_tier:
                e.rho3 = float(s["rho3"])
            if e.ef_spine is not None:
                e.ef_spine.copy_(s["ef_spine"] if s.get("ef_spine") is not None else torch.zeros_like(e.ef_spine))
            e.rho1, e.rho2, e.residuals = float(s["rho1"]), float(s["rho2"]), dict(s["residuals"])
            if e.ef is not None:   # a narrow payload's pending error (zero if saved without one)
                e.ef.copy_(s["ef"] if s.get("ef") is not None else torch.zeros_like(e.ef))
            if e.structured:
                e.set_masks(s["rows"].to(self.device).clone(), s["cols"].to(self.device).clone())
        self.round, self.frozen = int(sd["round"]), bool(sd["frozen"])
        self.stable_rounds, self.mask_drift = int(sd["stable_rounds"]), float(sd["mask_drift"])
        self.bytes = dict(NO_BYTES, **sd["bytes"])   # (older checkpoints lack cross_rack)
        saved = sd.get("round_buffers", {})   # absent in older checkpoints: saved at a round, buffers were averaged
        for (name, b), avg in zip(self.buffers, self._round_buffers):
            avg.copy_(saved.get(name, b))
        saved_ef = sd.get("buffer_ef", {})
        for (name, _), ef in zip(self.buffers, self._buffer_ef):
            ef.copy_(saved_ef[name] if name in saved_ef else torch.zeros_like(ef))
        saved_ef = sd.get("buffer_ef_spine", {})
        for (name, _), ef in zip(self.buffers, self._buffer_ef_spine):
            ef.copy_(saved_ef[name] if name in saved_ef else torch.zeros_like(ef))
        self._compact = self._support = self._grads = None
        self._in_flight = None
        if sd.get("in_flight") is not None:
            if not self.overlap:
                raise ValueError("engine state: it holds a round in flight (saved with overlap=True); resume it with "
                                 "overlap=True (the round is folded in after the next steps)")
            self._load_in_flight(sd["in_flight"])
        self._refresh_prox()
        self._set_compact_compute(afresh=True)   # from the loaded state and θ (load the model's first)

    def _load_in_flight(self, s: dict) -> None:
        """A checkpoint's round in flight, already received: folded in at the next round (or complete())."""
        layout = self._compact_layout()   # the round's masks are the entries' own (saved with them)
        if [b.numel() for b in layout.buffers] != [b.numel() for b in s["payload"]]:
            raise ValueError("engine state: the round in flight does not fit the saved masks' compact layout")
        for buf, saved in zip(layout.buffers, s["payload"]):
            buf.copy_(saved)
        before = []
        for e, (rows, cols) in zip(self.structured, s["masks_before"]):
            rows, cols = rows.to(self.device), cols.to(self.device)
            row_idx, col_idx = sparsity.masks_to_indices(rows, cols)
            before.append((rows, cols, row_idx, col_idx, sparsity.gather_plan(row_idx, col_idx, e.param.shape)))
        names = [e.name for e in self.entries]
        self._in_flight = _InFlight(
            steps=s["steps"], nonfinite=list(s["nonfinite"]),
            z_i=[s["z_i"][n].to(self.device).clone() for n in names],
            du=[s["du"][n].to(self.device).clone() for n in names],
            theta_sq=list(s["theta_sq"].to(self.device).unbind(0)),
            masks_before=(before, float(s["mask_drift_before"]), None), layout=layout, works=[],
            pending_ef=None if s["pending_ef"] is None else [t.to(self.device).clone() for t in s["pending_ef"]],
            received=True, steps_since=int(s["steps_since"]),
            theta_sent=None if s["theta_sent"] is None else [s["theta_sent"][n].to(self.device).clone() for n in names])
