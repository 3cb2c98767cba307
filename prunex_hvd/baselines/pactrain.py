"""PacTrain (Wang et al., 2025): prune once, then allreduce only the gradient entries the mask keeps.

    from prunex_hvd.baselines import pactrain
    opt = pactrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                        sparsity="channel:0.5", patience=3, terngrad=False)

The paper's algorithm (Sec. III-C), step by step, and where each step lives here:

1. *Initialization* — prune the (pre-trained or freshly broadcast) model once, unstructured: per conv layer
   keep the ``ceil(keep·numel)`` weights of largest ``|θ|`` (``score="magnitude"``), or of lowest GraSP
   score ``S = -θ ⊙ Hg`` (``score="grasp"``, Sec. III-D, scored on one batch per rank and summed over the
   world). ``θ ⊙= mask``.
2. *Training* — Gradient Sparsity Enforcement (GSE, Eq. 2): ``grad ⊙= mask`` every step, and
   ``θ ⊙= mask`` after every step, so momentum and weight decay cannot revive a pruned weight.
3. *Sparse mask update* — the Mask Tracker watches the flat (bucketed) gradient's mask: the weights' zero
   pattern on pruned layers, ones elsewhere. Ranks hold identical weights, so they agree on it without
   talking. Once it has not changed for ``patience`` consecutive steps it is *stable*.
4. *Synchronization* — stable: gather the kept entries of each bucket into a contiguous buffer, allreduce
   it (AVG), scatter back; unstable: the full dense allreduce ("full synchronisation for correctness").
   Optional TernGrad (Sec. III-D): what travels is ternarised against a scale shared by the world.

Tuning (what each knob does to speed and accuracy):

* ``sparsity`` — which conv weights are pruned and how much: the same specs as PruneX (``"channel:0.5"``,
  ``"filter:0.5+channel:0.5"``, ``{glob: spec}``), read as an *unstructured* kept fraction: the product of
  the spec's keep ratios (``channel:0.5`` keeps 50% of each conv layer's weights, ``filter:0.5+channel:0.5``
  25%), the fraction PruneX keeps, so the comparison is fair. Only the pruned layers shrink on the wire;
  BN, biases and the classifier travel dense, so the bytes saved are bounded by the conv share of the
  model. The paper reports < 2% accuracy loss up to 80% pruned (keep >= 0.2) when fine-tuning a
  pre-trained model; from scratch, keep more (0.5) or train longer.
* ``structure`` — ``"unstructured"`` (the paper's PacTrain: single weights) or ``"structured"``: the mask is
  the support of PruneX's own projection at the initial weights (whole input channels, filters, heads or MLP
  units, ``coupled`` as in PruneX), fixed for the run. Same density and the same kind of structure as PruneX,
  so it separates what the structure costs from what the consensus costs. Measured at ``channel:0.5``, 5 seeds
  (benchmarks/log/2026-11-25-pactrain-structured.md): 99.00% on digits and 98.50% on ResNet-18 against
  99.06% / 98.89% unstructured, and later to the targets (95% on digits after 8.2 epochs against 6.4). From
  scratch the channels chosen at init are close to random: a narrower network, trained data-parallel.
* ``score`` — ``magnitude`` needs no data and is what the paper's Fig. 2 describes; ``grasp`` keeps the
  weights whose removal would hurt the gradient flow most (better at init, where magnitudes carry little
  information) and needs ``grasp_batch`` (one batch per rank; a double backward, once).
* ``patience`` — full-sync steps the tracker waits before compacting. With a fixed pruning mask the
  pattern only changes if a kept weight lands exactly on 0, so a small value (1–3) is safe; larger values
  only cost dense steps. Resuming restores the tracker, so a restart does not pay the wait again.
* ``terngrad`` — each travelling entry becomes ``s·t``, ``t ∈ {-1, 0, 1}`` (int8, a quarter of fp32) with
  ``s`` = the world's max ``|g|`` in the bucket, and ``P(t = ±1) = |g|/s``: unbiased, but the variance per
  entry is ``|g|·s - g²`` — large when one entry dominates a bucket. Use it when the link, not the step,
  is the bottleneck; lower the learning rate or use smaller ``bucket_mb`` (a scale per smaller bucket
  tracks magnitudes more closely, at 4 bytes per bucket) if the loss gets noisy. Needs world size < 128
  (the int8 sum of ±1 from every rank must not overflow). Backends without int8 reductions (Horovod) widen
  it to int32 on the wire, which removes the saving there. Random draws are seeded from
  ``(seed, rank, step)``, so runs are reproducible.
* ``bucket_mb`` — size of the flat buffers (one collective per bucket); the compact buffers are cut from
  the same buckets.
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..dist import agreement, runtime
from ..engine.dependencies import structure_targets
from ..engine.config import ConsensusConfig, Structure
from ..engine.sparsity import coupled_masks, keep_count, resolve_specs, support_mask
from .common import MethodOptimizer, broadcast_model, check_wrapping, flat_layout, mix_into

SCORES = ("magnitude", "grasp")
STRUCTURES = ("unstructured", "structured")


# --------------------------------------------------------------------------------------------- masks

def _keep_fraction(spec) -> float:
    return math.prod(keep for _, keep in spec.parts)


def _select(scores: Tensor, k: int, largest: bool) -> Tensor:
    """Bool mask (same shape) of the ``k`` largest (or smallest) entries; ties go to the lowest index."""
    flat = scores.detach().reshape(-1)
    order = torch.sort(flat, descending=largest, stable=True).indices[:k]
    mask = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    mask[order] = True
    return mask.view(scores.shape)


def magnitude_masks(params: Dict[str, Tensor], keep: Dict[str, float]) -> Dict[str, Tensor]:
    """Per layer, keep the ``ceil(keep·numel)`` entries of largest ``|w|`` (ties: lowest index)."""
    return {name: _select(params[name].detach().abs(), keep_count(keep[name], params[name].numel()), largest=True)
            for name in keep}


def projection_masks(params: Dict[str, Tensor], structure) -> Dict[str, Tensor]:
    """Weight-shaped bool masks: the support ``rows ⊗ cols`` of PruneX's projection at ``params``
    (``structure``: a :class:`~prunex_hvd.engine.config.Structure`, its specs, couplings, streams and heads)."""
    support = coupled_masks(params, structure.specs, structure.couplings, structure.streams, structure.heads)
    return {name: support_mask(params[name], rows, cols) for name, (rows, cols) in support.items()}


def grasp_scores(model: torch.nn.Module, loss_fn: Callable, x: Tensor, y: Tensor,
                 names: Sequence[str]) -> Dict[str, Tensor]:
    """GraSP's score ``S = -θ ⊙ (H g)`` for the parameters ``names`` (Wang et al., 2020; PacTrain Eq. 4).

    ``g = ∇L`` over those parameters, ``Hg = ∇(gᵀ·stopgrad(g))`` by double backprop. The model's
    parameters, gradients and buffers (BN running statistics) are left as they were."""
    params = dict(model.named_parameters())
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"grasp_scores: no parameter named {missing[0]!r}")
    weights = [params[n] for n in names]
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    try:
        loss = loss_fn(model(x), y)
        grads = torch.autograd.grad(loss, weights, create_graph=True)
        z = sum((g * g.detach()).sum() for g in grads)
        hg = torch.autograd.grad(z, weights)
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(saved[n])
    return {n: -(w.detach() * h.detach()) for n, w, h in zip(names, weights, hg)}


def grasp_masks(scores: Dict[str, Tensor], keep: Dict[str, float]) -> Dict[str, Tensor]:
    """GraSP removes the weights of HIGHEST score: keep the ``ceil(keep·numel)`` lowest (ties: lowest index)."""
    return {name: _select(scores[name], keep_count(keep[name], scores[name].numel()), largest=False)
            for name in keep}


# --------------------------------------------------------------------------------------------- mask tracker

class MaskTracker:
    """The paper's Mask Tracker (MT) over the reformatted flat gradient: one bool mask per flat bucket.

    :meth:`observe` takes this step's masks; the pattern is *stable* once it has been unchanged for
    ``patience`` consecutive observations (the first observation counts as a change). While stable, the
    kept indices per bucket are computed once and cached."""

    def __init__(self, patience: int):
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an integer >= 1, got {patience!r}")
        self.patience = patience
        self.masks: Optional[List[Tensor]] = None
        self.unchanged = 0
        self.version = 0          # bumped on every change: anything cached from the masks is stale
        self._indices: Optional[List[Tensor]] = None
        self._count = None

    @property
    def stable(self) -> bool:
        return self.masks is not None and self.unchanged >= self.patience

    def observe(self, masks: Sequence[Tensor]) -> bool:
        """Record this step's masks (not kept by reference). Returns :attr:`stable`."""
        same = (self.masks is not None and len(masks) == len(self.masks)
                and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(masks, self.masks)))
        if same:
            self.unchanged += 1
        else:
            if self.masks is not None and len(masks) == len(self.masks) \
                    and all(a.shape == b.shape for a, b in zip(masks, self.masks)):
                for dst, src in zip(self.masks, masks):
                    dst.copy_(src)
            else:
                self.masks = [m.detach().to(torch.bool).clone() for m in masks]
            self.unchanged = 0
            self.version += 1
            self._indices = None
        return self.stable

    def indices(self) -> List[Tensor]:
        """Positions of the kept entries in each bucket (int64, ascending), cached until the masks change."""
        if self.masks is None:
            raise RuntimeError("MaskTracker.indices(): nothing observed yet")
        if self._indices is None:
            self._indices = [torch.nonzero(m, as_tuple=False).reshape(-1) for m in self.masks]
        return self._indices

    def count(self) -> int:
        """Kept entries over all buckets (what a compact step sends); 0 before the first observation.
        Counted once per mask pattern."""
        if self.masks is None:
            return 0
        if self._count is None or self._count[0] != self.version:
            self._count = (self.version, sum(int(m.sum()) for m in self.masks))
        return self._count[1]

    def state_dict(self) -> dict:
        return {"patience": self.patience, "unchanged": self.unchanged,
                "masks": None if self.masks is None else [m.cpu().clone() for m in self.masks]}

    def load_state_dict(self, state: dict, device=None) -> None:
        masks = state["masks"]
        self.masks = None if masks is None else [torch.as_tensor(m, dtype=torch.bool).to(device) for m in masks]
        self.unchanged = int(state["unchanged"])
        self.version += 1
        self._indices = None


# --------------------------------------------------------------------------------------------- TernGrad

def ternarize(flat: Tensor, scale, generator: Optional[torch.Generator] = None) -> Tensor:
    """TernGrad: ``t = sign(g)·Bernoulli(|g|/scale)`` as int8 in {-1, 0, 1}; unbiased, ``E[scale·t] = g``.

    ``scale`` must be ``>= max|g|`` (a probability above 1 would bias it); a zero scale gives zeros.
    ``generator`` lives on ``flat``'s device."""
    work = flat.detach()
    if not work.is_floating_point() or work.dtype in (torch.float16, torch.bfloat16):
        work = work.float()
    scale = torch.as_tensor(scale, dtype=work.dtype, device=work.device)
    u = torch.rand(work.shape, generator=generator, dtype=work.dtype, device=work.device)
    fire = u < work.abs() / scale            # 0/0 = nan: never fires
    return torch.where(fire, torch.sign(work), torch.zeros((), dtype=work.dtype, device=work.device)).to(torch.int8)


def step_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit generator seed from (seed, rank, step): reproducible, different per rank and step."""
    digest = hashlib.blake2b(f"pactrain:{seed}:{rank}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


# --------------------------------------------------------------------------------------------- optimizer

class _PacTrain(MethodOptimizer):
    """Mixed into the user's optimizer class by :func:`DistributedOptimizer`; see the module docstring."""

    _tag = "gradients"

    def __init__(self, params, model, world, masks, patience, terngrad, bucket_mb, seed):
        super(self.__class__, self).__init__(params)
        self._method_setup(model, world)
        self._terngrad, self._seed, self._bucket_mb = bool(terngrad), int(seed), bucket_mb
        names = {id(p): n for n, p in model.named_parameters()}
        self._layout = flat_layout(self._params, bucket_mb)
        lay = self._layout
        # pruned entries: (k, name, param, bool mask, float flat mask, flat bool view of the tracked mask)
        self._masks: Dict[str, Tensor] = {}
        self._pruned = []
        self._tracked = [torch.ones(b.numel(), dtype=torch.bool, device=b.device) for b in lay.buffers]
        for k, p in enumerate(self._params):
            name = names[id(p)]
            if name not in masks:
                continue
            mask = masks[name].to(device=p.device, dtype=torch.bool).reshape(p.shape)
            self._masks[name] = mask
            b, off = lay.place[k]
            self._pruned.append((k, name, p, mask, mask.reshape(-1).to(p.dtype),
                                 self._tracked[b][off: off + p.numel()]))
        self._gse = {k: fmask for k, _, _, _, fmask, _ in self._pruned}   # param index -> flat 0/1 mask
        self._tracker = MaskTracker(patience)
        self._compact: list = []
        self._compact_version = -1
        self._generator = None
        self._kept_cache = None
        self._apply_masks()

    # -- the four steps ----------------------------------------------------------------------------
    @torch.no_grad()
    def _apply_masks(self) -> None:
        for _, _, p, _, fmask, _ in self._pruned:
            p.mul_(fmask.view_as(p))

    @torch.no_grad()
    def _communicate(self) -> None:
        lay = self._layout
        fmasks = self._gse
        for k, p in enumerate(self._params):          # GSE (Eq. 2) while packing the flat buckets
            view = lay.views[k]
            if p.grad is None:
                view.zero_()
            elif k in fmasks:
                torch.mul(p.grad.reshape(-1), fmasks[k], out=view)
            else:
                view.copy_(p.grad.reshape(-1))
        for _, _, p, _, _, tview in self._pruned:      # MT: the weights' zero pattern, ones elsewhere
            torch.ne(p.detach().reshape(-1), 0, out=tview)
        if self._tracker.observe(self._tracked):
            plan = self._compact_plan()
            payloads = []
            for buf, idx, compact in plan:
                if idx is None:                       # every entry kept: the bucket travels as it is
                    payloads.append(buf)
                elif compact is not None:             # gather the kept entries into a contiguous buffer
                    torch.index_select(buf, 0, idx, out=compact)
                    payloads.append(compact)
            self._reduce(payloads)
            for buf, idx, compact in plan:            # scatter back; what did not travel is 0
                if idx is not None:
                    buf.zero_()
                    if compact is not None:
                        buf.index_copy_(0, idx, compact)
        else:
            self._reduce(lay.buffers)
        for k, p in enumerate(self._params):
            if p.grad is None:
                p.grad = lay.views[k].view_as(p).clone()
            else:
                p.grad.copy_(lay.views[k].view_as(p.grad))

    def _compact_plan(self):
        """Per bucket ``(buffer, indices or None when all are kept, compact buffer or None when none is)``,
        built once per tracked mask and reused while it holds."""
        if self._compact_version != self._tracker.version:
            self._compact = []
            for idx, buf in zip(self._tracker.indices(), self._layout.buffers):
                if idx.numel() == buf.numel():
                    self._compact.append((buf, None, None))
                else:
                    self._compact.append((buf, idx, torch.empty(idx.numel(), dtype=buf.dtype, device=buf.device)
                                          if idx.numel() else None))
            self._compact_version = self._tracker.version
        return self._compact

    def _reduce(self, payloads: List[Tensor]) -> None:
        """Average ``payloads`` over the world in place: plain allreduce-AVG, or TernGrad's
        shared-scale (allreduce-MAX), int8 allreduce-SUM, ``g = s·Σt / N``."""
        world = self._world
        if not payloads:
            return
        if not self._terngrad:
            for t in payloads:
                world.allreduce_(t, "avg")
            return
        scales = torch.stack([t.abs().amax() for t in payloads])
        world.allreduce_(scales, "max")
        if self._generator is None:
            self._generator = torch.Generator(device=payloads[0].device)
        self._generator.manual_seed(step_seed(self._seed, world.rank, self._steps))
        for b, t in enumerate(payloads):
            q = ternarize(t, scales[b], self._generator)
            world.allreduce_(q, "sum")
            torch.mul(q, scales[b] / world.size, out=t)

    def _after_step(self) -> None:
        self._apply_masks()

    # -- reporting and state -----------------------------------------------------------------------
    def _kept(self) -> Dict[str, int]:
        # stats() runs every step: count the (fixed) masks once, not with a device sync per layer per step
        if self._kept_cache is None:
            self._kept_cache = {name: int(m.sum()) for name, m in self._masks.items()}
        return self._kept_cache

    def layer_density(self) -> Dict[str, float]:
        return {name: kept / self._masks[name].numel() for name, kept in self._kept().items()}

    def density(self) -> float:
        total = sum(m.numel() for m in self._masks.values())
        return sum(self._kept().values()) / total if total else 1.0

    def _extra_stats(self):
        return {"mask_stable": self._tracker.stable, "compact_elements": self._tracker.count(),
                "terngrad": self._terngrad}

    def _method_state(self):
        return {"masks": {n: m.cpu().clone() for n, m in self._masks.items()},
                "tracker": self._tracker.state_dict()}

    def _load_method_state(self, state) -> None:
        masks = state.get("masks")
        if masks is None or set(masks) != set(self._masks):
            raise ValueError(f"this PacTrain state prunes {sorted(masks or {})}, this optimizer "
                             f"{sorted(self._masks)}: same model and sparsity needed")
        for name, mask in self._masks.items():
            if tuple(masks[name].shape) != tuple(mask.shape):
                raise ValueError(f"PacTrain state: mask {name!r} has shape {tuple(masks[name].shape)}, "
                                 f"the parameter {tuple(mask.shape)}")
        tracker = state["tracker"]
        saved = tracker["masks"]
        if saved is not None and [int(m.numel()) for m in saved] != [b.numel() for b in self._layout.buffers]:
            raise ValueError("PacTrain state was saved with another bucket layout (bucket_mb): resume with "
                             "the same bucket_mb")
        for _, name, _, mask, fmask, _ in self._pruned:
            mask.copy_(masks[name].to(mask.device))
            fmask.copy_(mask.reshape(-1))
        self._kept_cache = None
        self._tracker.load_state_dict(tracker, device=self._layout.buffers[0].device)
        self._apply_masks()


def DistributedOptimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, sparsity="channel:0.5",
                         score: str = "magnitude", patience: int = 3, terngrad: bool = False,
                         bucket_mb: float = 32, backend: Optional[str] = None, seed: int = 0,
                         grasp_batch=None, structure: str = "unstructured", coupled=False):
    """Wrap ``optimizer`` (over ``model``'s parameters) to train with PacTrain; see the module docstring.

    Collective: every rank constructs it; rank 0's parameters and float buffers are broadcast to all, the
    model is pruned in place (GraSP: ``grasp_batch = (x, y)``, this rank's batch; scores are summed over the
    world, one-time traffic tagged ``setup`` and not counted as the method's; ``structure="structured"``:
    PruneX's projection, with ``coupled`` as PruneX takes it). Returns an instance of the
    optimizer's own class with ``stats()``, ``density()``, ``finalize()`` and a resumable ``state_dict()``."""
    def checks():
        held = check_wrapping(optimizer, model, bucket_mb)
        if score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, got {score!r}")
        if structure not in STRUCTURES:
            raise ValueError(f"structure must be one of {', '.join(STRUCTURES)}, got {structure!r}")
        if structure == "structured" and score != "magnitude":
            raise ValueError("structure='structured' keeps whole channels, filters or heads by their L2 norm (PruneX's "
                             "projection); GraSP scores single weights: use score='magnitude'")
        if structure == "unstructured" and coupled:
            raise ValueError("coupled ties channels across layers: it needs structure='structured' (single weights "
                             "have no channels to tie)")
        if score == "grasp":
            if grasp_batch is None:
                raise ValueError("score='grasp' needs grasp_batch=(x, y): one training batch of this rank")
            if not (isinstance(grasp_batch, (tuple, list)) and len(grasp_batch) == 2
                    and all(isinstance(t, Tensor) for t in grasp_batch)):
                raise ValueError("grasp_batch must be a pair of tensors (x, y)")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an integer >= 1, got {patience!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if not held:
            raise ValueError("the optimizer holds no parameters")
        if len({(p.dtype, p.device) for p in held}) > 1:
            raise ValueError("PacTrain packs gradients into flat buffers: the optimizer's parameters must share one "
                             f"dtype and device, got {sorted({(str(p.dtype), str(p.device)) for p in held})}")
        # the same layers PruneX's spec would hold (heads, MLP neurons too), each pruned unstructured at its keep;
        # structured: PruneX's own resolution (its couplings, streams and heads too)
        resolved = Structure.resolve(model, ConsensusConfig(sparsity=sparsity, coupled=coupled)) \
            if structure == "structured" else None
        specs = resolved.specs if resolved is not None else \
            resolve_specs(model.named_parameters(), sparsity, structure_targets(model))
        held_ids = {id(p) for p in held}
        named = dict(model.named_parameters())
        outside = [n for n in specs if id(named[n]) not in held_ids]
        if outside:
            raise ValueError(f"sparsity prunes {outside[0]!r}, which the optimizer does not train")
        keep = {name: _keep_fraction(spec) for name, spec in specs.items()}
        # what coupled resolves to follows from the model (its signature is agreed) and the argument
        return (held, specs, keep, resolved), {"sparsity": {n: str(v) for n, v in specs.items()}, "score": score,
                                               "patience": patience, "seed": seed, "terngrad": terngrad,
                                               "bucket_mb": bucket_mb, "structure": structure, "coupled": coupled}
    held, specs, keep, resolved = agreement.checked_construction("the PacTrain optimizer", backend, model, checks)
    named = dict(model.named_parameters())

    from ..dist.comm import groups as comm_groups
    world = comm_groups(backend).world
    if terngrad and world.size >= 128:
        raise ValueError(f"terngrad sums int8 values in [-1, 1] over the world: needs fewer than 128 ranks, "
                         f"this job has {world.size}")
    broadcast_model(model, world)

    if resolved is not None:   # every rank holds rank 0's weights now: the same masks without talking
        masks = projection_masks({n: named[n].detach() for n in resolved.specs}, resolved)
    elif score == "magnitude":
        masks = magnitude_masks({n: named[n] for n in keep}, keep)
    else:
        masks = _grasp_world_masks(model, world, grasp_batch, keep, bucket_mb)
    return mix_into(optimizer, _PacTrain, model, world, masks, patience, terngrad, bucket_mb, seed)


def _grasp_world_masks(model, world, batch, keep, bucket_mb) -> Dict[str, Tensor]:
    """GraSP on every rank's own batch, scores summed over the world, masks from the sum (then rank 0's
    masks broadcast, so float summation order can never split the ranks). One-time, tagged ``setup``."""
    control = runtime.state()[1]
    names = list(keep)
    device = next(model.parameters()).device
    scores, error = None, None
    try:
        x, y = (t.to(device) for t in batch)
        scores = grasp_scores(model, F.cross_entropy, x, y, names)
    except (ValueError, RuntimeError, TypeError, IndexError) as exc:
        error = f"GraSP scoring failed: {type(exc).__name__}: {exc}"
    control.agree(error, ValueError)           # no rank goes into the allreduce alone
    if not names:
        return {}
    tensors = [scores[n] for n in names]
    layout = flat_layout(tensors, bucket_mb)
    for k, t in enumerate(tensors):
        layout.views[k].copy_(t.reshape(-1))
    with world.ledger.tagged("setup"):
        for buf in layout.buffers:
            world.allreduce_(buf, "sum")
    summed = {n: layout.views[k].view_as(tensors[k]) for k, n in enumerate(names)}
    masks = grasp_masks(summed, keep)
    # sent as uint8: bool has no MPI datatype everywhere, uint8 broadcasts work on every backend
    packed = flat_layout([masks[n].to(torch.uint8) for n in names], bucket_mb)
    for k, n in enumerate(names):
        packed.views[k].copy_(masks[n].reshape(-1))
    with world.ledger.tagged("setup"):
        for buf in packed.buffers:
            world.broadcast_(buf, root=0)
    return {n: packed.views[k].view_as(masks[n]).bool().clone() for k, n in enumerate(names)}
