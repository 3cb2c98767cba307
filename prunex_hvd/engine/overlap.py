"""The overlapped round (``overlap``; docs/algorithm.md, "Overlapped rounds"): the round's inter-node exchange left
in flight while the next local steps run, and folded in (phases 5–10) after ``overlap_steps`` of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from . import admm, sparsity
from .buckets import BucketLayout


@dataclass
class InFlight:
    """A round whose inter-node exchange is in flight: what its fold needs."""
    steps: Optional[int]
    nonfinite: List[bool]
    z_i: List[torch.Tensor]          # the node's new z_i
    du: List[torch.Tensor]           # u's step, θ − z_i, θ as the round sent it
    theta_sq: List[torch.Tensor]     # ‖θ − z_i‖² per entry, the same θ
    masks_before: tuple              # put back if the round is refused
    layout: BucketLayout             # the compact buckets: the average, once received
    works: list                      # the leaders' async allreduces (none once received)
    pending: Optional[list]          # a narrow payload's new bases and errors (leaders)
    theta_sent: Optional[List[torch.Tensor]] = None   # θ as sent (restart: the fold rebases the steps since on z)
    received: bool = False
    steps_since: int = 0             # local steps taken since it started (overlap_steps folds it in)


class OverlappedRounds:
    """The round in flight (:attr:`in_flight`) of ``engine`` (an :class:`prunex_hvd.engine.hsadmm.HSADMM`, whose
    phases it runs): started by :meth:`start`, folded in by :meth:`fold` after ``fold_after`` local steps, at the
    next round, or by ``complete()`` / ``finalize()``; a checkpoint receives it first and records it."""

    def __init__(self, engine):
        self.engine = engine
        self.enabled = engine.config.overlap_steps is not None and engine.state.inter_tier
        self.fold_after = engine.config.overlap_steps or 0   # the local step after which the round is folded in
        self.in_flight: Optional[InFlight] = None

    def start(self, steps: Optional[int]) -> tuple:
        """Fold in the round in flight if no step did (phases 5–10), then run this round's phases 1–4 and leave its
        inter-node exchange in flight, from θ as sent. Only the steps taken before the fold see stale values: the
        point they start from and ρ1 (the previous round's). Returns (the wait, the compact buckets)."""
        eng = self.engine
        wait = self.fold() if self.in_flight is not None else 0.0
        nonfinite, z_i_new, masks_before, layout = eng.start_round()   # 1–4 (the mask OR blocks; it is small)
        du = [e.param.detach().sub(z) for e, z in zip(eng.entries, z_i_new)]   # u's step, θ as sent
        theta_sq = [admm.sq_norm(d) for d in du]
        works = eng.exchange.start(layout)            # 4. the exchange starts; the node goes on stepping
        self.in_flight = InFlight(steps=steps, nonfinite=nonfinite, z_i=z_i_new, du=du, theta_sq=theta_sq,
                                  masks_before=masks_before, layout=layout, works=works,
                                  pending=eng.codec.pending,
                                  theta_sent=[e.param.detach().clone() for e in eng.entries]
                                  if eng.config.restart != "none" else None)
        eng.codec.pending = None
        eng.steps.refresh_prox(self.in_flight)   # the local steps pull toward this round's z_i already
        return wait, layout

    def after_step(self) -> None:
        f = self.in_flight
        if f is not None:
            f.steps_since += 1
            if f.steps_since == self.fold_after:
                self.engine.complete()

    def receive(self) -> float:
        """The round in flight's exchange completes: the leaders wait for it, then hand it to their node.
        Returns the seconds this rank waited (the exposed part of the exchange)."""
        f = self.in_flight
        if f.received:
            return 0.0
        wait = self.engine.exchange.receive(f.works, f.layout)
        f.received, f.works = True, []
        return wait

    def fold(self) -> float:
        """Phases 5–10 of the round in flight, as the blocking round runs them (the duals from θ as the round
        sent it); θ, which went on stepping from where it was sent, moves by z − θ_sent (``restart="global"``):
        the restart, with the steps taken since kept on top."""
        eng, f = self.engine, self.in_flight
        wait = self.receive()
        self.in_flight, eng.codec.pending = None, f.pending
        eng.codec.anchored = eng.codec.is_anchored(f.layout)
        try:                                          # 5–9 (a rank's own buffers follow its steps)
            eng.settle(f.z_i, f.layout, f.nonfinite, f.steps, f.theta_sq, f.masks_before, du=f.du,
                       own_buffers=True)
        except BaseException:   # refused: the committed state is the previous round's, so is the prox cache
            eng.steps.refresh_prox()
            raise
        if f.theta_sent is not None:                  # 10. restart, late: θ += z − θ_sent
            with torch.no_grad():
                for e, sent in zip(eng.entries, f.theta_sent):
                    e.param.add_(sent.neg_().add_(e.z.to(e.param.dtype)))   # θ_sent is not needed again
        eng.steps.set_compact_compute()
        return wait

    # -- save and load --------------------------------------------------------------------------------------
    def state_dict(self) -> Optional[dict]:
        """The round in flight, already received (the caller received it), or None."""
        f = self.in_flight
        if f is None:
            return None
        names = [e.name for e in self.engine.entries]
        return {
            "steps": f.steps, "nonfinite": list(f.nonfinite),
            "z_i": dict(zip(names, (t.clone() for t in f.z_i))), "du": dict(zip(names, (t.clone() for t in f.du))),
            "theta_sq": torch.stack(f.theta_sq).cpu(), "payload": [b.clone() for b in f.layout.buffers],
            "masks_before": [(m[0].clone(), m[1].clone()) for m in f.masks_before[0]],
            "mask_drift_before": f.masks_before[1],
            "pending": None if f.pending is None else [t.clone() for t in f.pending],
            "steps_since": f.steps_since,
            "theta_sent": None if f.theta_sent is None else dict(zip(names, (t.clone() for t in f.theta_sent)))}

    def load_state_dict(self, s: Optional[dict]) -> None:
        """A checkpoint's round in flight, already received: folded in at the next round (or complete())."""
        self.in_flight = None
        if s is None:
            return
        if not self.enabled:
            raise ValueError("engine state: it holds a round in flight (saved with overlap=True); resume it with "
                             "overlap=True (the round is folded in after the next steps)")
        eng = self.engine
        device = eng.state.device
        # the round's masks are the entries' own (saved with them), its payload's dtype the saved one
        layout = eng.masks.compact_layout(s["payload"][0].dtype if s["payload"] else None)
        if [b.numel() for b in layout.buffers] != [b.numel() for b in s["payload"]]:
            raise ValueError("engine state: the round in flight does not fit the saved masks' compact layout")
        for buf, saved in zip(layout.buffers, s["payload"]):
            buf.copy_(saved)
        before = []
        for e, (rows, cols) in zip(eng.structured, s["masks_before"]):
            rows, cols = rows.to(device), cols.to(device)
            row_idx, col_idx = sparsity.masks_to_indices(rows, cols)
            before.append((rows, cols, row_idx, col_idx, sparsity.gather_plan(row_idx, col_idx, e.param.shape)))
        names = [e.name for e in eng.entries]
        self.in_flight = InFlight(
            steps=s["steps"], nonfinite=list(s["nonfinite"]),
            z_i=[s["z_i"][n].to(device).clone() for n in names],
            du=[s["du"][n].to(device).clone() for n in names],
            theta_sq=list(s["theta_sq"].to(device).unbind(0)),
            masks_before=(before, float(s["mask_drift_before"]), None), layout=layout, works=[],
            pending=None if s.get("pending") is None else [t.to(device).clone() for t in s["pending"]],
            received=True, steps_since=int(s["steps_since"]),
            theta_sent=None if s["theta_sent"] is None else [s["theta_sent"][n].to(device).clone() for n in names])
