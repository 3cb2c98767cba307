"""A change of nodes (elastic training; docs/algorithm.md, "Nodes lost and joined"): the survivors going on over
the nodes left, from memory (:func:`reform`), and a node that joins a running job (:func:`joiner`, :func:`welcome`).

A joining rank starts where the consensus stands: θ = z_i = z, its duals u and v_i at zero, the masks, ρ, the round
counter and the last round's float buffers as every other rank holds them. It takes them from the lowest rank that
holds a state, in three broadcasts over the job: the round's facts, the masks, then z on the masks' support (the
compact values: a pruned entry is 0 everywhere) with the float buffers. Ranks that hold a state keep theirs.

:func:`facts` / :func:`take` are the pure halves (tensors in, state out); :func:`welcome` carries them through
the exchange.
"""
from __future__ import annotations

import zlib
from typing import List

import torch

from . import sparsity
from .state import ConsensusState

HOLDS, ROUND, SIGNATURE = range(3)   # the columns of each rank's row in the first allgather


def signature(state: ConsensusState) -> int:
    """A number that differs between jobs that cannot share a consensus: the parameters' names, shapes and dtypes,
    and what each structured one is pruned to."""
    text = repr([(e.name, tuple(e.param.shape), str(e.param.dtype), str(e.spec)) for e in state.entries])
    return zlib.crc32(text.encode())


def facts(state: ConsensusState) -> torch.Tensor:
    """The round counter, the freeze, and ρ1, ρ2 of every entry, as one float64 tensor."""
    head = [state.round, float(state.frozen), state.stable_rounds, state.mask_drift]
    return torch.tensor(head + [e.rho1 for e in state.entries] + [e.rho2 for e in state.entries],
                        dtype=torch.float64)


def values(state: ConsensusState) -> torch.Tensor:
    """z on its support (structured entries: the kept block, :func:`sparsity.shrink`), then the last round's float
    buffers, as one tensor in the state's dtype."""
    parts = [sparsity.shrink(e.z, e.row_idx, e.col_idx).reshape(-1) if e.structured else e.z.reshape(-1)
             for e in state.entries]
    parts += [b.reshape(-1).to(state.state_dtype) for b in state.round_buffers]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=state.state_dtype, device=state.device)


def numel_of_values(state: ConsensusState) -> int:
    """The size of :func:`values` under the masks this rank holds."""
    return sum(e.compact_numel() for e in state.entries) + sum(b.numel() for b in state.round_buffers)


def take(state: ConsensusState, job_facts: torch.Tensor, flat_values: torch.Tensor) -> None:
    """A joining rank's state from the job's (masks already taken): z from the compact values
    (:func:`sparsity.recover`), z_i = z, θ = z, the duals u, v_i at zero, ρ, the round counter and freeze, the float
    buffers. No base of a narrow payload: the next round sends whole values."""
    n = len(state.entries)
    head, rho1, rho2 = job_facts[:4].tolist(), job_facts[4:4 + n].tolist(), job_facts[4 + n:4 + 2 * n].tolist()
    offset = 0
    with torch.no_grad():
        for e, r1, r2 in zip(state.entries, rho1, rho2):
            kept = e.compact_numel()
            block = flat_values[offset:offset + kept]
            z = sparsity.recover(block, e.row_idx, e.col_idx, e.z.shape) if e.structured else block.view_as(e.z)
            z = z.to(e.z.dtype).clone()
            offset += kept
            e.z, e.z_i = z, z.clone()
            e.u.zero_()
            e.v.zero_()
            if e.sent is not None:
                e.sent = z.clone()
            e.rho1, e.rho2 = float(r1), float(r2)
            e.param.copy_(z.to(e.param.dtype))
        for (_, b), kept_avg in zip(state.buffers, state.round_buffers):
            kept_avg.copy_(flat_values[offset:offset + b.numel()].view_as(b).to(kept_avg.dtype))
            b.copy_(kept_avg)
            offset += b.numel()
    state.round, state.frozen = int(head[0]), bool(head[1])
    state.stable_rounds, state.mask_drift = int(head[2]), float(head[3])
    state.anchored_at = None


def refusal(rows: torch.Tensor) -> str | None:
    """Why the job cannot go on, from every rank's (holds a state, round, signature) row, or None. The same answer
    on every rank: every rank reads the same rows."""
    holders = [r for r in range(len(rows)) if rows[r, HOLDS]]
    if not holders:
        return ("no rank holds the job's state: every node that trained was lost at once; resume from the last "
                "checkpoint (--resume)")
    rounds = sorted({int(rows[r, ROUND]) for r in holders})
    if len(rounds) > 1:
        return f"the ranks that trained are at different rounds ({rounds}): resume from the last checkpoint"
    want = int(rows[holders[0], SIGNATURE])
    other = [r for r in range(len(rows)) if int(rows[r, SIGNATURE]) != want]
    if other:
        return (f"rank(s) {_ranks(other)} joined with another model or structure than the job's (parameter "
                "names, shapes, dtypes or sparsity differ): every node must build the same model with the same "
                "settings")
    return None


def _ranks(ranks: List[int]) -> str:
    return ",".join(map(str, ranks[:8])) + (",…" if len(ranks) > 8 else "")


def reform(engine, topo, groups) -> None:
    """The nodes changed: ``engine`` goes on over ``topo`` and ``groups`` from memory, keeping this rank's own state
    (θ, u, its node's z_i and v_i, z, ρ, the masks, the round); a lost node's duals left with it, and with one node
    left v_i is dropped too (the one-node round has z = z_i). No communication
    (the caller built ``groups`` on every rank). The next round sends whole values: a narrow payload's bases were
    sums over the nodes before."""
    if engine.overlap.in_flight is not None:
        raise RuntimeError("the nodes changed with a round in flight (overlap): elastic training runs without overlap")
    saved = engine.state_dict()
    engine.build(topo, groups, broadcast=False)
    engine.load_state_dict(saved)
    engine.state.anchored_at = None
    if not engine.state.inter_tier:   # one node left: no constraint across nodes, so no dual for it (z = z_i)
        for e in engine.entries:
            e.v.zero_()


def joiner(engine_cls, model, topo, groups, config, structure, ledger=None):
    """The engine of a rank that joins a running job (no communication): built from its own model, as at
    construction but without rank 0's broadcast, until :func:`welcome` hands it the job's state."""
    engine = engine_cls.__new__(engine_cls)
    engine.config, engine.structure, engine.model, engine._ledger = config, structure, model, ledger
    engine.build(topo, groups, broadcast=False)
    return engine


def release(engine) -> None:
    """Drop the engine's groups before the nodes change (:func:`reform` brings new ones)."""
    engine.exchange.groups = None


def welcome(engine, joined: bool) -> dict:
    """Collective over the job, after :func:`reform` (or :func:`joiner`) on every rank: the ranks that ``joined``
    take the job's state from the lowest rank that holds one. Returns who joined, the round and the rank they took
    it from. Refused on every rank (:func:`refusal`) if no rank holds a state, the holders are at different
    rounds, or a rank's model or structure differs."""
    s, exchange = engine.state, engine.exchange
    rows = exchange.job_rows(torch.tensor([0 if joined else 1, s.round, signature(s)], dtype=torch.int64))
    why = refusal(rows)
    if why is not None:
        raise ValueError(f"the job cannot go on over these nodes: {why}")
    joiners = [r for r in range(len(rows)) if not rows[r, HOLDS]]
    if not joiners:
        return {"joined": [], "round": s.round}
    root = next(r for r in range(len(rows)) if rows[r, HOLDS])
    job_facts = exchange.from_rank_(facts(s).to(s.device), root).cpu()
    if s.structured:
        masks = exchange.from_rank_(engine.masks.flat([(e.rows, e.cols) for e in s.structured]), root)
        if joined:
            for e, (rows, cols) in zip(s.structured, engine.masks.split(masks)):
                e.set_masks(rows, cols)
    flat_values = exchange.from_rank_(
        torch.zeros(numel_of_values(s), dtype=s.state_dtype, device=s.device) if joined else values(s), root)
    if joined:
        take(s, job_facts, flat_values)
        engine.masks.forget_layout()
        engine.steps.forget_layout()
        engine.steps.refresh_prox()
        engine.steps.set_compact_compute(afresh=True)
    return {"joined": joiners, "round": s.round, "from": root, "values": int(flat_values.numel())}
