"""The consensus state of one rank: per layer (:class:`Entry`: θ's dual u, z_i, its dual v, z, ρ, masks), the float
buffers' last averages, the round counter and the freeze, with the job's fixed facts; saved and loaded whole.

No communication here: the components of a round (:mod:`prunex_hvd.engine.hsadmm`) read and update this state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from . import admm, sparsity
from .buckets import BucketLayout
from .config import PAYLOAD_DTYPES, ConsensusConfig, Structure


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
    sent: Optional[torch.Tensor] = None    # a narrow payload: what this node leader has sent, summed (its base)
    w: Optional[torch.Tensor] = None       # three tiers: the rack consensus w_r (v is then z_i's dual against it)
    t: Optional[torch.Tensor] = None       # w_r's dual against z
    rho3: float = 0.0                      # w_r's pull toward z
    sent_spine: Optional[torch.Tensor] = None   # three tiers, narrow payload: the rack leader's base
    rack_sum: Optional[torch.Tensor] = None     # three tiers, narrow payload: the sum of the rack's nodes' bases

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


class ConsensusState:
    """What one rank holds of the consensus, and the facts of the job it was made for (``topo``, ``config``, the
    model's dtype and device, which tiers exist). Every rank of a node holds the same z_i, v and z."""

    def __init__(self, model: torch.nn.Module, topo, config: ConsensusConfig, structure: Structure):
        self.topo, self.config = topo, config
        self.bucket_bytes = int(config.bucket_mb * 2**20)
        self.params = [(n, p) for n, p in model.named_parameters()]
        self.buffers = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
        dtypes = {p.dtype for _, p in self.params} | {b.dtype for _, b in self.buffers}
        devices = {p.device for _, p in self.params} | {b.device for _, b in self.buffers}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"the consensus packs every parameter and float buffer into shared buckets, so they "
                             f"must share one dtype and device; got dtypes {sorted(map(str, dtypes))}, devices "
                             f"{sorted(map(str, devices))}")
        self.dtype, self.device = dtypes.pop(), devices.pop()   # the payload's dtype: the model's
        self.state_dtype = admm.state_dtype(self.dtype)
        self.inter_tier = topo.num_nodes > 1   # one node: z = z_i, nothing to balance across nodes
        # racks: θ → z_i → w_r → z (one rack, or one node per rack, is the two-tier round unchanged)
        self.rack_tier = self.inter_tier and config.rack_tier and bool(topo.rack_nodes) and topo.num_racks > 1
        # what crosses nodes; narrower than the state: each sender's change against its own base (codec.py). One
        # node sends nothing across nodes: z = z_i + v in the model's dtype, not rounded to a payload's
        self.payload_dtype = (PAYLOAD_DTYPES[config.payload_dtype] if self.inter_tier else None) or self.dtype
        self.delta_coded = (self.inter_tier and config.payload_dtype is not None
                            and self.payload_dtype.itemsize < self.state_dtype.itemsize)
        self.specs = structure.specs
        self.entries: List[Entry] = []
        self.structured: List[Entry] = []
        self.round = 0
        # a narrow payload: the round whose whole values last set every base (0: the start, every base z; None:
        # the bases are unknown, so the next round sends whole values)
        self.anchored_at: Optional[int] = None
        self.frozen = False
        self.finalized = False   # finalize() wrote the consensus model: training has ended
        self.stable_rounds = 0
        self.mask_drift = 0.0

    def start(self) -> None:
        """The entries from the model's parameters (broadcast first: every rank starts from rank 0's) with z = z_i
        = θ, the duals at zero and the masks all ones; the float buffers' average is their value."""
        config = self.config
        for name, p in self.params:
            theta = p.detach().to(self.state_dtype)
            e = Entry(name, p, self.specs.get(name), u=torch.zeros_like(theta), z_i=theta.clone(),
                      v=torch.zeros_like(theta), z=theta.clone(), rho1=float(config.rho1), rho2=float(config.rho2),
                      sent=theta.clone() if self.delta_coded and self.topo.is_leader else None)   # starts at z
            if self.rack_tier:   # w_r starts where z does, its dual at zero
                e.w, e.t = theta.clone(), torch.zeros_like(theta)
                e.rho3 = float(config.rho3 if config.rho3 is not None else config.rho2)
                if self.delta_coded:   # the rack's sum of its nodes' bases N·z (every rank), its leader's base z
                    e.rack_sum = theta * self.topo.nodes_per_rack
                    e.sent_spine = theta.clone() if self.topo.is_rack_leader else None
            if e.structured:   # masks start all ones
                c_out = theta.shape[0]
                e.set_masks(torch.ones(c_out, dtype=torch.bool, device=self.device),
                            torch.ones(theta.numel() // c_out, dtype=torch.bool, device=self.device))
            self.entries.append(e)
        self.structured = [e for e in self.entries if e.structured]
        self.anchored_at = 0 if self.delta_coded else None
        self.round_buffers = [b.clone() for _, b in self.buffers]   # averaged in the last round: z's partner
        self.buffer_ef = [torch.zeros_like(b, dtype=self.state_dtype) for _, b in self.buffers] \
            if self.delta_coded else []
        self.buffer_ef_spine = [torch.zeros_like(ef) for ef in self.buffer_ef] if self.rack_tier else []

    def layout(self, param_numels, zero_tail: int = 0, dtype: Optional[torch.dtype] = None) -> BucketLayout:
        """Buckets for one number per parameter, then the float buffers (always dense), in ``dtype`` (the
        model's by default)."""
        return BucketLayout(list(param_numels) + [b.numel() for _, b in self.buffers], dtype or self.dtype,
                            self.device, self.bucket_bytes, zero_tail=zero_tail)

    def accept(self, z_i_new: List[torch.Tensor], z_new: List[torch.Tensor], w_new: Optional[List[torch.Tensor]],
               du: Optional[List[torch.Tensor]] = None) -> None:
        """Phase 7, the round accepted: v_i += z_i − z, u += θ − z_i (``du``: that step, formed when θ was sent);
        with racks v_i += z_i − w_r and t_r += w_r − z; then the new z_i (w_r) and z."""
        for k, e in enumerate(self.entries):
            admm.update_dual(e.v, z_i_new[k], z_new[k] if w_new is None else w_new[k])
            if du is None:
                admm.update_dual(e.u, e.param.detach(), z_i_new[k])
            else:
                e.u.add_(du[k])
            if w_new is not None:
                admm.update_dual(e.t, w_new[k], z_new[k])
                e.w = w_new[k]
            e.z_i, e.z = z_i_new[k], z_new[k]

    def accept_buffers(self, averages: List[torch.Tensor], own_buffers: bool = False) -> None:
        """The float buffers averaged in the round, kept (with z they are the consensus model) and taken by every
        rank, unless ``own_buffers`` (overlap: a rank's running statistics have followed its steps since it sent
        them, and keep doing so)."""
        for (_, b), kept, avg in zip(self.buffers, self.round_buffers, averages):
            kept.copy_(avg)
            if not own_buffers:
                b.copy_(avg)

    def write_consensus_model(self) -> None:
        """z and the last round's float buffers into the model (under ``torch.no_grad()``)."""
        for e in self.entries:
            e.param.copy_(e.z)
        for (_, b), avg in zip(self.buffers, self.round_buffers):
            b.copy_(avg)

    # -- save and load --------------------------------------------------------------------------------------
    def owner(self) -> dict:
        """Whose state this is: each rank holds its own duals (u, z_i), so a state loads on its own rank only."""
        return {"rank": self.topo.rank, "size": self.topo.size,
                "node_ranks": [list(ranks) for ranks in self.topo.node_ranks]}

    def check_owner(self, sd: dict) -> None:
        """A ``ValueError`` saying what to do unless ``sd`` was saved by this rank of a job laid out as this one
        (a state that names no owner is taken as it is)."""
        saved, mine = sd.get("owner"), self.owner()
        if saved is None or saved == mine:
            return
        if (saved["size"], saved["node_ranks"]) != (mine["size"], mine["node_ranks"]):
            raise ValueError(f"this optimizer state was saved by a job of {saved['size']} ranks as nodes "
                             f"{saved['node_ranks']}, this job is {mine['size']} ranks as nodes {mine['node_ranks']}: "
                             "resume with the same ranks and nodes")
        raise ValueError(f"this optimizer state is rank {saved['rank']}'s, loaded on rank {mine['rank']}: each rank "
                         "holds its own duals (u, z_i), so save the state on every rank and load each rank's own "
                         "file, e.g. torch.save(opt.state_dict(), f'opt.rank{hvd.rank()}.pt')")

    def state_dict(self) -> dict:
        return {
            "owner": self.owner(),
            "round": self.round, "anchored_at": self.anchored_at, "frozen": self.frozen,
            "stable_rounds": self.stable_rounds,
            "mask_drift": self.mask_drift,
            "entries": {e.name: {"u": e.u.clone(), "z_i": e.z_i.clone(), "v": e.v.clone(), "z": e.z.clone(),
                                 "rho1": e.rho1, "rho2": e.rho2, "residuals": dict(e.residuals),
                                 "rows": None if e.rows is None else e.rows.clone(),
                                 "cols": None if e.cols is None else e.cols.clone(),
                                 "sent": None if e.sent is None else e.sent.clone(),
                                 **({"w": e.w.clone(), "t": e.t.clone(), "rho3": e.rho3,
                                     "sent_spine": None if e.sent_spine is None else e.sent_spine.clone(),
                                     "rack_sum": None if e.rack_sum is None else e.rack_sum.clone()}
                                    if e.w is not None else {})}
                        for e in self.entries},
            "round_buffers": {name: b.clone() for (name, _), b in zip(self.buffers, self.round_buffers)},
            "buffer_ef": {name: ef.clone() for (name, _), ef in zip(self.buffers, self.buffer_ef)},
            "buffer_ef_spine": {name: ef.clone() for (name, _), ef in zip(self.buffers, self.buffer_ef_spine)},
        }

    def load_state_dict(self, sd: dict) -> None:
        """Refused, naming what differs, unless ``sd`` was saved for this model, tiers and version."""
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
            e.rho1, e.rho2, e.residuals = float(s["rho1"]), float(s["rho2"]), dict(s["residuals"])
            for key in ("sent", "sent_spine", "rack_sum"):   # a narrow payload's bases
                if getattr(e, key) is not None and s.get(key) is not None:
                    getattr(e, key).copy_(s[key])
            if e.structured:
                e.set_masks(s["rows"].to(self.device).clone(), s["cols"].to(self.device).clone())
        self.round, self.frozen = int(sd["round"]), bool(sd["frozen"])
        # saved without bases (another payload, or an earlier version; the same on every rank): anchor the next round
        self.anchored_at = sd.get("anchored_at") if self.delta_coded else None
        self.stable_rounds, self.mask_drift = int(sd["stable_rounds"]), float(sd["mask_drift"])
        saved = sd.get("round_buffers", {})   # absent in older checkpoints: saved at a round, buffers were averaged
        for (name, b), avg in zip(self.buffers, self.round_buffers):
            avg.copy_(saved.get(name, b))
        for key, efs in (("buffer_ef", self.buffer_ef), ("buffer_ef_spine", self.buffer_ef_spine)):
            saved_ef = sd.get(key, {})
            for (name, _), ef in zip(self.buffers, efs):
                ef.copy_(saved_ef[name] if name in saved_ef else torch.zeros_like(ef))
