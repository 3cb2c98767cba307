"""The checks that refuse a round, or a step, on every rank alike: ranks at different rounds or step counts, inf or
NaN anywhere (the round's verdict, riding on the residuals' job-wide sum), and ``node_sync``'s guard before each
step's gradient average.
"""
from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional

import torch

from . import admm
from .buckets import BucketLayout
from .state import ConsensusState

log = logging.getLogger(__name__)

IN_STEP, AT_ROUND = 1.0, 2.0   # where a rank is, in node_sync's guard


def _ranks(ranks: List[int]) -> str:
    return ",".join(map(str, ranks))


def nonfinite(dense: BucketLayout, n: int) -> List[bool]:
    """Per entry (then one for all float buffers): does this rank's θ + u (the dense views before the intra sum)
    hold inf or NaN? One check per bucket when all is well."""
    views = dense.views
    if all(bool(torch.isfinite(b).all()) for b in dense.buffers):
        return [False] * (n + 1)
    return [not bool(torch.isfinite(views[k]).all()) for k in range(n)] + \
        [any(not bool(torch.isfinite(v).all()) for v in views[n:])]


class Verdict:
    """Phase 6: the residuals' squares summed over the job, with every rank's round, step count and inf/NaN flags
    in the same sum (no extra collective), so every rank takes the same verdict before any state changes."""

    def __init__(self, state: ConsensusState, exchange):
        self.state, self.exchange = state, exchange

    def __call__(self, z_i_new, z_new, flags: List[bool], steps: Optional[int], theta_sq: List[torch.Tensor],
                 w_new: Optional[List[torch.Tensor]] = None):
        """Returns the summed residual squares per entry (r_intra², s_intra², r_inter²; with racks then s_inter²,
        r_spine²) and the top tier's s² per entry (from z: the same everywhere); raises on every rank alike."""
        s, topo = self.state, self.state.topo
        P, M, n = topo.local_size, topo.num_nodes, len(s.entries)
        width = 3 if w_new is None else 5
        local_sq = torch.zeros(n, width, dtype=torch.float64, device=s.device)   # on the device: no sync per layer
        s_inter_sq = torch.zeros(n, dtype=torch.float64, device=s.device)
        for k, e in enumerate(s.entries):
            local_sq[k, 0] = theta_sq[k]
            upper = z_new[k] if w_new is None else w_new[k]   # the consensus z_i answers to
            if topo.is_leader:   # node-level terms: once per node, the dual one for the node's P copies
                local_sq[k, 1] = admm.dual_residual_sq(admm.sq_norm(z_i_new[k] - e.z_i), e.rho1, P)
                local_sq[k, 2] = admm.sq_norm(z_i_new[k] - upper)
            if w_new is None:
                s_inter_sq[k] = admm.dual_residual_sq(admm.sq_norm(z_new[k] - e.z), e.rho2, M)   # M copies of z
                continue
            if topo.is_rack_leader:   # rack-level terms: once per rack, the dual one for its N copies
                local_sq[k, 3] = admm.dual_residual_sq(admm.sq_norm(w_new[k] - e.w), e.rho2, topo.nodes_per_rack)
                local_sq[k, 4] = admm.sq_norm(w_new[k] - z_new[k])
            s_inter_sq[k] = admm.dual_residual_sq(admm.sq_norm(z_new[k] - e.z), e.rho3, topo.num_racks)
        size = topo.size
        who = self._row_of_this_rank(steps, flags)
        where = torch.tensor(flags, dtype=torch.float64)    # per entry, then the float buffers
        summed = self.exchange.sum_over_job(torch.cat([local_sq.reshape(-1), who.reshape(-1).to(s.device),
                                                       where.to(s.device)]))
        s_inter_sq = s_inter_sq.tolist()   # from the global z: the same on every rank, read once
        totals = summed[:width * n].view(n, width)
        try:
            self._check(summed[width * n: width * n + 3 * size].view(-1, 3), summed[width * n + 3 * size:],
                        totals, s_inter_sq)
        except (RuntimeError, FloatingPointError) as exc:   # refused, on every rank alike
            if topo.rank == 0:   # the raised error says why; the log marks where in the run
                log.error("round %d refused (%s): every rank keeps the state of round %d",
                          s.round + 1, type(exc).__name__, s.round)
            raise
        return totals, s_inter_sq

    def _row_of_this_rank(self, steps: Optional[int], flags: List[bool]) -> torch.Tensor:
        """This rank's row of the round's check (round, step count, any inf/NaN), in a table of one row per rank:
        summed over the job, every row is filled (:meth:`_check` reads it)."""
        s = self.state
        who = torch.zeros(s.topo.size, 3, dtype=torch.float64)
        who[s.topo.rank] = torch.tensor([s.round + 1, -1 if steps is None else steps, float(any(flags))])
        return who

    def _check(self, who: torch.Tensor, where: torch.Tensor, totals: torch.Tensor, s_inter_sq: List[float]) -> None:
        """Refuse the round if the ranks were not at the same round and step count, or if inf/NaN showed up
        anywhere. Every input is the same on every rank (job-wide sums, and s_inter from the global z), so is the
        verdict. Raised before any state is updated: the engine (and the last checkpoint) stay at the previous
        round."""
        s = self.state

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
                f"consensus round {s.round + 1}: the ranks took different numbers of optimizer steps "
                f"({by_value(who[:, 1])}). Every rank must step as often between rounds (equal data shards, drop "
                f"the last partial batch), else a round averages models of different ages and the last rounds "
                f"cannot line up")
        n = len(s.entries)
        bad_ranks = [r for r, flag in enumerate(who[:, 2].tolist()) if flag]
        bad = ["the float buffers (BatchNorm running statistics)"] if where[n] else []
        bad += [s.entries[k].name for k in range(n)
                if where[k] or not (bool(torch.isfinite(totals[k]).all()) and math.isfinite(s_inter_sq[k]))]
        if bad or bad_ranks:
            shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            source = (f"θ + u of rank{'s' if len(bad_ranks) > 1 else ''} {_ranks(bad_ranks)}" if bad_ranks
                      else "the consensus (it overflowed from finite inputs"
                      + ("; payload_dtype='fp16' holds changes up to 65504 only: use 'bf16'"
                         if s.payload_dtype == torch.float16 and s.delta_coded else "") + ")")
            if bad_ranks and s.config.node_sync and s.topo.local_size > 1:
                source += (" (node_sync: the ranks of a node average their gradients, so one rank's bad batch "
                           "reaches every rank of its node)")
            raise FloatingPointError(
                f"consensus round {s.round + 1}: inf or NaN in {shown or 'the model'}, from {source}. Every "
                f"rank stops here with the state of round {s.round}: lower the learning rate or rho, check "
                f"the data, and resume from the last checkpoint")


class NodeGuard:
    """``node_sync``'s guard: a node's ranks talk every step, so a rank with one batch more than the others would
    pair its step's gradient average with their round's sum (a hang, or a transport error on some ranks).
    Before either, every rank writes where it is (in a step, at a round) and its step count into its slot of one
    small job-sized vector, summed over the node. Where no rank of the node is at a round that is all. At a round
    the leaders also sum it over the job (a leader still in a step whose node's others are at the round too:
    every leader sums once a round) and hand it to their node. Ranks not at the same point raise the same error,
    naming them: the other ranks of a node at fault as soon as they see it, everyone else from the job's sum. On
    the CPU, so a CUDA job does not wait on its device every step."""

    def __init__(self, state: ConsensusState, exchange, traffic):
        self.state, self.exchange, self.traffic = state, exchange, traffic

    def __call__(self, where: float, steps: Optional[int]) -> None:
        topo, exchange = self.state.topo, self.exchange
        size, node_ranks = topo.size, topo.local_ranks
        cpu = exchange.groups.backend != "nccl"
        seen = torch.zeros(2 * size, dtype=torch.float64, device="cpu" if cpu else self.state.device)
        seen[topo.rank], seen[size + topo.rank] = where, -1 if steps is None else steps
        before = exchange.ledger.summary()
        with exchange.ledger.tagged("guard"):
            exchange.node_sum_(seen)
            node_ok = len({float(seen[r]) for r in node_ranks}) == 1 and \
                len({float(seen[size + r]) for r in node_ranks}) == 1
            at_round = any(float(seen[r]) == AT_ROUND for r in node_ranks)
            if at_round and topo.num_nodes > 1:
                if not node_ok and not topo.is_leader:
                    raise RuntimeError(self._message(seen))
                exchange.up_the_tree_(seen)
                if node_ok:
                    exchange.node_broadcast_(seen)
        self.traffic.count(before)
        if node_ok and not at_round:   # every rank of the node in this step
            return
        if node_ok and len(set(seen[:size].tolist())) == 1 and len(set(seen[size:].tolist())) == 1:
            return
        raise RuntimeError(self._message(seen))

    def _message(self, seen: torch.Tensor) -> str:
        size = self.state.topo.size
        ranks = [r for r in range(size) if seen[r] != 0]   # the slots filled: the node's, or the job's
        where = {r: ("in a local step" if float(seen[r]) == IN_STEP else f"at consensus round {self.state.round + 1}")
                 + (f" after {int(seen[size + r])} steps" if seen[size + r] >= 0 else "") for r in ranks}
        groups: Dict[str, List[int]] = {}
        for r in ranks:
            groups.setdefault(where[r], []).append(r)
        said = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)} {w}" for w, rs in groups.items())
        return (f"node_sync: the ranks are not at the same point ({said}). Every rank must take the same number of "
                f"optimizer steps between rounds (equal data shards, drop the last partial batch): the ranks of a "
                f"node average their gradients every step, so one more step on one rank would meet its node's round")
