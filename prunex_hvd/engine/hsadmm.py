"""One H-SADMM consensus round (PruneX Algorithm 1, made exact in docs/algorithm.md), over the node and leader groups.

Every rank of node i holds the same z_i, v_i and z (:mod:`.state`); leaders (local rank 0) alone talk across nodes
(:mod:`.exchange`, :mod:`.racks`). A round, each phase one call into a component:

 1. intra-node allreduce-SUM of θ + u and of the float buffers   exchange.intra_sum
 2. node candidate z̃_i, the exact argmin in z_i                  admm.node_candidate
 3. z_i = Π_S(z̃_i); leaders OR the row/col masks                masks.project (z_i ⊙ m once frozen)
 4. leaders code z_i + v_i on the global support and average it   codec.fill, exchange.average
    across nodes, handed down to the node (racks: through w_r)
 5. every rank recovers z from the compact buckets                 codec.recover
 6. verdict: ranks at another round or step count, inf/NaN         verdict (refused on every rank, nothing changed)
 7. v_i += z_i − z,  u += θ − z_i; the float buffers averaged     state.accept, codec.commit
 8. residuals per layer; adaptive ρ with the duals rescaled        rho.adapt
 9. masks frozen when due, at exactly the requested structure      masks.due, masks.freeze
10. ``restart="global"``: every rank's θ starts the next round at z

Between rounds each local step runs :mod:`.steps` (node gradient average with its guard, the proximal term
ρ1(θ − z_i + u), θ held on the frozen structure). With ``overlap``, once the masks are frozen a round stops after
phase 4 has started the leaders' exchange, and :mod:`.overlap` folds phases 5–10 in after the next
``overlap_steps`` local steps. Byte counts and the round's report: :mod:`.report`.

The consensus model (:meth:`HSADMM.finalize`, :meth:`HSADMM.consensus_weights`) is the last round's: z and the
float buffers averaged in that round, the same on every rank whatever steps were taken since.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import List, Optional

import torch

from ..dist import watchdog
from . import admm, rho, sparsity
from .codec import PayloadCodec
from .config import ConsensusConfig, Structure
from .exchange import Exchange
from .masks import MaskPolicy
from .overlap import OverlappedRounds
from .racks import RackExchange
from .report import NO_BYTES, Traffic
from .state import ConsensusState
from .steps import StepHooks
from .verdict import AT_ROUND, NodeGuard, Verdict

__all__ = ["HSADMM"]


class HSADMM:
    """The consensus state of one rank and the round that updates it, under ``config`` (``rho_max`` a number:
    :meth:`ConsensusConfig.with_rho_max_from` resolves ``"auto"``) on ``structure`` (what the config resolves to on
    the model; resolved here when not given). Transport comes from ``groups`` (a
    :class:`prunex_hvd.dist.comm.Groups`), used by the exchange alone."""

    def __init__(self, model: torch.nn.Module, topo, groups, config: ConsensusConfig,
                 structure: Optional[Structure] = None, ledger=None):
        if config.rho_max == "auto":
            raise ValueError("rho_max='auto' is derived from the optimizer's lr and momentum, which the engine does "
                             "not see: pass config.with_rho_max_from(lr, momentum), or a number")
        self.config, self.structure = config, structure or Structure.resolve(model, config)
        self.model, self._ledger = model, ledger
        self.build(topo, groups, broadcast=True)                    # every rank starts from rank 0's model
        if config.freeze_round == 0:   # masks chosen at the start: every round trains the pruned model
            self.steps.start_frozen()
        else:
            self.steps.refresh_prox()

    def build(self, topo, groups, broadcast: bool) -> None:
        """The state from θ and the components over ``groups`` (``broadcast``: rank 0's θ first; a change of nodes
        builds without it, :mod:`.joining`)."""
        self.state = ConsensusState(self.model, topo, self.config, self.structure)
        tiers = RackExchange if self.state.rack_tier else Exchange   # (the racks refuse what they cannot run)
        self.exchange = tiers(self.state, groups, self._ledger)
        if broadcast:
            self.exchange.broadcast_model()
        self.state.start()
        self.codec = PayloadCodec(self.state)
        self.masks = MaskPolicy(self.state, self.structure, self.exchange)
        self.traffic = Traffic(self.state, self.exchange)
        self.verdict = Verdict(self.state, self.exchange)
        self.guard = NodeGuard(self.state, self.exchange, self.traffic)
        self.steps = StepHooks(self.state, self.model, self.masks, self.exchange, self.guard, self.traffic)
        self.overlap = OverlappedRounds(self)
        self.steps.set_compact_compute(afresh=True)   # layers an earlier engine left compact are made plain

    # -- what the wrapper and the trainer read ------------------------------------------------------------
    topo = property(lambda self: self.state.topo)
    entries = property(lambda self: self.state.entries)
    structured = property(lambda self: self.state.structured)
    round = property(lambda self: self.state.round)
    frozen = property(lambda self: self.state.frozen)
    finalized = property(lambda self: self.state.finalized)
    bytes = property(lambda self: self.traffic.bytes)
    exchange_wait_s = property(lambda self: self.traffic.exchange_wait_s)
    density = property(lambda self: self.masks.density)             # kept fraction of the structured weights
    layer_density = property(lambda self: self.masks.layer_density)

    # -- every local step: the wrapped optimizer's hooks (steps.py) --------------------------------------
    syncs_node_grads = property(lambda self: self.steps.syncs_node_grads)
    sync_node_grads = property(lambda self: self.steps.sync_node_grads)
    add_proximal_grad = property(lambda self: self.steps.add_proximal_grad)

    def after_step(self) -> None:
        """θ back on the frozen structure; with ``overlap``, the round in flight folded in after its steps."""
        self.steps.after_step()
        self.overlap.after_step()

    # -- the round ----------------------------------------------------------------------------------------
    def consensus_round(self, steps: Optional[int] = None) -> dict:
        """One round (collective); ``steps``, this rank's optimizer steps, go into the verdict. A rank that never
        arrives stops the job, named (:mod:`prunex_hvd.dist.watchdog`)."""
        if self.state.finalized:
            raise RuntimeError("consensus round after finalize(): finalize() ends training (the model now holds "
                               "the consensus z); to evaluate the consensus mid-run use consensus_weights()")
        with watchdog.waiting(f"consensus round {self.state.round + 1}", world=True):
            if self.steps.syncs_node_grads:
                self.guard(AT_ROUND, steps)
            t0, before = time.perf_counter(), self.exchange.ledger.summary(by_op=False)
            if self.overlap.enabled and self.state.frozen:   # 1–4 now, 5–10 after the next steps
                wait, payload = self.overlap.start(steps)
            else:
                wait, payload = self._round(steps)
            return self.traffic.round(before, time.perf_counter() - t0, payload, wait,
                                      self.overlap.in_flight is not None, self.masks.density())

    def _round(self, steps: Optional[int]) -> tuple:
        """Algorithm 1 as its phases (numbered as in the module docstring and docs/algorithm.md)."""
        nonfinite, z_i_new, masks_before, layout = self.start_round()               # 1–4 up to the exchange
        t_wire = time.perf_counter()
        w_new = self.exchange.average(layout, self.codec, self.masks.gathers)      # 4. across nodes (racks: w_r)
        wait = time.perf_counter() - t_wire
        theta_sq = [admm.sq_norm(e.param.detach() - z) for e, z in zip(self.entries, z_i_new)]
        self.settle(z_i_new, layout, nonfinite, steps, theta_sq, masks_before, w_new=w_new)   # 5–9
        if self.config.restart != "none":                                          # 10. θ at the consensus
            with torch.no_grad():
                for e in self.entries:
                    e.param.copy_(e.z)
        self.steps.set_compact_compute()
        return wait, layout

    def start_round(self) -> tuple:
        """Phases 1–4 up to the exchange: (this rank's inf/NaN flags, the new z_i, the masks to put back if the
        round is refused, the compact buckets filled)."""
        s = self.state
        nonfinite = self.exchange.intra_sum()                                     # 1. Σ_node (θ + u)
        sums, P = self.exchange.dense.views, s.topo.local_size                    # 2. node candidate z̃_i
        z_i_new = [admm.node_candidate(sums[k].view_as(e.z), e.w if s.rack_tier else e.z, e.v, e.rho1, e.rho2, P)
                   for k, e in enumerate(s.entries)]
        masks_before = self.masks.saved()                                         #    (put back if refused at 6)
        self.masks.project(z_i_new)                                               # 3. Π_S and the leaders' OR
        layout = self.masks.compact_layout(self.codec.round_dtype())             # 4. the compact payload
        self.codec.fill(layout, z_i_new, self.exchange.dense.views)
        return nonfinite, z_i_new, masks_before, layout

    def settle(self, z_i_new, layout, nonfinite, steps, theta_sq, masks_before, du=None,
               own_buffers: bool = False, w_new: Optional[List[torch.Tensor]] = None) -> None:
        """Phases 5–9 once the exchange has arrived in ``layout``; a refused round puts the masks back and raises.
        With ``du`` (overlap: u's step as θ was sent) the proximal cache already holds this round's u and z_i,
        and is kept unless ρ1 moved; ``own_buffers``: a rank's running statistics keep following its steps."""
        z_new = self.codec.recover(layout, self.masks.gathers)                    # 5. z from the compact buckets
        try:                                                                      # 6. verdict, job-wide
            totals, s_top_sq = self.verdict(z_i_new, z_new, nonfinite, steps, theta_sq, w_new)
        except BaseException:
            self.masks.restore(masks_before)
            raise
        self.state.accept(z_i_new, z_new, w_new, du)                              # 7. duals, z_i, z
        self.state.accept_buffers(self.codec.decode_buffers(layout), own_buffers)
        self.codec.commit()
        rho1_before = [e.rho1 for e in self.entries]
        rho.adapt(self.state, totals, s_top_sq)                                   # 8. residuals, adaptive ρ
        if du is None or rho1_before != [e.rho1 for e in self.entries]:
            self.steps.refresh_prox()
        self.state.round += 1
        if self.masks.due():                                                      # 9. freezing
            self.masks.freeze()
            self.steps.forget_layout()
            self.steps.refresh_prox()
            self.masks.say_frozen()

    def complete(self) -> None:
        """Fold in the round in flight now (``overlap``; collective), so z, the duals and ρ are every round's."""
        if self.overlap.in_flight is not None:
            with watchdog.waiting(f"consensus round {self.state.round + 1} (completing)", world=True):
                before = self.exchange.ledger.summary()
                self.traffic.exchange_wait_s += self.overlap.fold()
                self.traffic.count(before)

    # -- the consensus model ------------------------------------------------------------------------------
    def finalize(self) -> None:
        """Write the consensus model into the model: the global z and the float buffers averaged in the last
        round, so every rank holds the same, exactly structurally sparse model (no communication; steps since the
        last round are not in it). If nodes' masks still differed (their OR is larger than asked), z is projected
        onto the requested structure first. Training ends here: a later round raises. A round in flight is
        folded in first."""
        self.complete()
        with torch.no_grad():
            for e, (rows, cols) in zip(self.structured, self.masks.masks({e.name: e.z for e in self.structured})):
                e.z.copy_(sparsity.apply_masks(e.z, rows, cols))
            self.state.write_consensus_model()
        self.state.finalized = True
        self.steps.set_compact_compute()   # the user gets plain layers back

    @contextmanager
    def consensus_weights(self):
        """The consensus model (as :meth:`finalize` writes it) in the model for the duration, identical on every
        rank without any communication; θ and this rank's own buffers are restored after."""
        saved = [e.param.detach().clone() for e in self.entries]
        saved_buffers = [b.clone() for _, b in self.state.buffers]
        with torch.no_grad():
            self.state.write_consensus_model()
        try:
            yield
        finally:
            with torch.no_grad():
                for e, theta in zip(self.entries, saved):
                    e.param.copy_(theta)
                for (_, b), old in zip(self.state.buffers, saved_buffers):
                    b.copy_(old)

    # -- save and load --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The engine's state, to resume bit for bit. A round in flight is received first (collective, as a
        checkpoint is) and recorded as it stands, to be folded in at the same point of the resumed run."""
        if self.overlap.in_flight is not None:
            before = self.exchange.ledger.summary()
            self.traffic.exchange_wait_s += self.overlap.receive()
            self.traffic.count(before)
        sd = dict(self.state.state_dict(), bytes=dict(self.traffic.bytes))
        in_flight = self.overlap.state_dict()
        if in_flight is not None:
            sd["in_flight"] = in_flight
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Load the model's state first: compact compute is decided from this state and θ."""
        self.state.load_state_dict(sd)
        self.traffic.bytes = dict(NO_BYTES, **sd["bytes"])
        self.masks.forget_layout()
        self.steps.forget_layout()
        self.overlap.load_state_dict(sd.get("in_flight"))
        self.steps.refresh_prox(self.overlap.in_flight)
        self.steps.set_compact_compute(afresh=True)
