"""``DistributedOptimizer``: wrap any torch optimizer so training runs H-SADMM over the cluster topology.

    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), model,
                                  sparsity="channel:0.5", local_steps=100)

Tuning (what each knob does to speed and accuracy):

* ``local_steps`` — wrapped steps between consensus rounds. Communication happens only in rounds, so
  traffic falls as 1/local_steps; too many steps let ranks drift apart (higher primal residual, slower
  agreement). The paper uses 5–10 local epochs per round on CIFAR; start with one epoch per round.
* the wrapped optimizer's ``lr`` — between rounds each rank steps on its own batch, where data-parallel SGD
  steps on the average of all ranks' batches. Coming from a dense recipe with lr L over W ranks, start at
  about L / W (the linear scaling rule). Measured with ResNet-18, 2×2 ranks and batch 16: lr 0.05 reached
  0.80 test accuracy after 15.5 epochs, lr 0.0125 after 11.
* ``rho1`` — pull of each rank's θ toward its node consensus z_i, added to every gradient. Larger: ranks of a
  node stay together and the structure is reached sooner, at the cost of freedom to fit local data
  (accuracy). ``rho2`` — pull of each node toward the global z; keep it ~10× smaller than rho1 so nodes can
  differ while their masks settle. ``adaptive_rho`` balances primal and dual residuals per layer (×/÷2 when
  one is 10× the other, capped at ``rho_max``), which makes the defaults safe across models.
* ``sparsity`` — the structure to keep: ``"filter:K"``, ``"channel:K"``, ``"shape:K"`` (K = fraction KEPT),
  joined with ``"+"`` (applied filter → channel → shape), or ``{name_glob: spec}`` per layer (``"dense"``
  excludes a layer). Only conv weights (4-D) are structured; the rest joins the consensus densely. Inter-node
  traffic shrinks with the kept fraction. A ``ConvTranspose2d`` must be left dense, and a grouped conv may
  only lose output filters (``filter:K``): the error names the layer and the dict to write. A stage that can
  remove nothing from a layer (``channel:K`` on a 1-channel stem or a depthwise conv) is one warning on rank 0.
* ``freeze_round`` / ``freeze_patience`` — masks stop moving after that round, or once the global mask is
  unchanged for that many rounds; then buffers are allocated once and projection is skipped.
* ``masked_retrain`` — after freezing, keep θ on the frozen structure (gradients and weights masked): the
  paper's retraining phase, so the model trained from then on is the pruned model itself. Freeze early
  enough to leave epochs for it (a third to a half of the run works well).
* ``coupled`` — channel pruning with dependencies (Torch-Pruning's "group"): when conv B reads conv A's
  output through BatchNorm/activations only, B's input channel c and A's filter c are pruned together,
  ranked by their joint norm. ``channel:0.5`` then also halves A's filters: inter-node traffic falls from
  ~0.50× to ~0.3–0.4× of dense on ResNets, and the final model is that much smaller, at some accuracy
  (A is pruned on both sides). ``coupled="streams"`` also makes each residual stream one group: every conv
  reading it (input channel c) and writing into it (filter c) shares one channel set, keep ratio from the
  readers' ``channel:K`` (they must agree), so export can remove the whole pruned fraction. A stream with a
  reader or writer other than a plain conv (``groups=1``), e.g. the last one read by the linear head, keeps
  per-layer masks. Needs a ``torch.fx``-traceable model.
* ``weight_decay_z`` — λ of the z-step (a ridge on the consensus itself); 0 leaves decay to the optimizer.
* ``bucket_mb`` — size of the flat buffers packed for each collective (one collective per bucket).
* ``hierarchical=False`` — the paper's "PruneX (AR)" ablation: one flat consensus over the world group
  (every rank allreduces its dense θ + u, the projection applies to the global variable). Same math with
  M = 1 node of all ranks; it shows what the hierarchy saves.
* float16 / bfloat16 models train as they are: the consensus state and its arithmetic stay float32 (as AMP
  keeps master weights), what travels is in the model's dtype.
* ``finalize()`` ends training with the consensus model (z and the last round's averaged BatchNorm
  statistics) on every rank; ``consensus_weights()`` lends it for an evaluation mid-run.
"""
from __future__ import annotations

import math
import warnings
from numbers import Real
from typing import Any, Dict, Optional, Tuple

import torch

from .dist import agreement, runtime
from .dist.comm import groups as comm_groups
from .dist.comm.base import Groups, SingleCommunicator
from .engine import dependencies
from .engine.hsadmm import HSADMM
# names, not the module: the factory's `sparsity` argument shadows it
from .engine.sparsity import check_layer_types, resolve_specs, stages_removing_nothing, stream_keep


COUPLING_MODES = (False, True, "pairs", "streams")


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class (as Horovod does), so schedulers and isinstance checks work."""

    records_per_epoch = False   # talks once a round: the trainer logs every round

    def __init__(self, params, model, specs, couplings, streams, local_steps, rho1, rho2, rho_max, adaptive_rho,
                 weight_decay_z, freeze_round, freeze_patience, bucket_mb, backend, masked_retrain, hierarchical):
        super(self.__class__, self).__init__(params)
        topo = runtime.topology()
        self._local_steps = local_steps
        self._step_count_local = 0
        groups = comm_groups(backend)
        if not hierarchical:   # PruneX (AR): one consensus group over the world, no leaders' tier
            topo, groups = topo.flattened(), Groups(
                world=groups.world, intra=groups.world, backend=groups.backend,
                inter=SingleCommunicator("inter", [topo.rank], [topo.node], 0) if topo.rank == 0 else None)
        self._engine = HSADMM(model, topo, groups,
                              specs, rho1, rho2, rho_max, adaptive_rho, weight_decay_z, freeze_round,
                              freeze_patience, bucket_mb, masked_retrain=masked_retrain, couplings=couplings,
                              streams=streams)
        self._last_report: Optional[dict] = None

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("prunex_hvd.DistributedOptimizer does not take a closure: the proximal term is added "
                             "to the gradients between backward() and step()")
        if self._engine.finalized:
            raise RuntimeError("step() after finalize(): finalize() ends training and leaves the consensus model "
                               "in place; to evaluate mid-run without ending it, use consensus_weights()")
        self._engine.add_proximal_grad()
        loss = super(self.__class__, self).step()
        self._engine.after_step()
        self._step_count_local += 1
        if self._step_count_local % self._local_steps == 0:
            self.consensus()
        return loss

    def consensus(self) -> dict:
        """Run a consensus round now (collective: every rank must call it). Returns the round's report."""
        self._last_report = self._engine.consensus_round(steps=self._step_count_local)
        return self._last_report

    def finalize(self) -> None:
        """End training: write the consensus model (the global z, exactly at the requested structure, and the
        BatchNorm statistics averaged in the last round) into the model, the same on every rank (see
        :meth:`HSADMM.finalize`). ``step()`` and ``consensus()`` raise after it."""
        self._engine.finalize()

    def rounds_done(self) -> int:
        """Consensus rounds so far: cheap, for a training loop's every step (``stats()`` is not)."""
        return self._engine.round

    def consensus_weights(self):
        """Context manager: the model holds the consensus model (z and the last round's BatchNorm statistics:
        the pruned model so far, identical on every rank, no communication) inside it."""
        return self._engine.consensus_weights()

    def stats(self) -> dict:
        eng = self._engine
        return {
            "rounds": eng.round, "steps": self._step_count_local,
            "inter_bytes": eng.bytes["inter"], "intra_bytes": eng.bytes["intra"],
            "inter_consensus_bytes": eng.bytes["inter_consensus"], "dense_inter_bytes": eng.bytes["dense_inter"],
            "density": eng.density(), "layer_density": eng.layer_density(), "mask_drift": eng.mask_drift,
            "frozen": eng.frozen, "residuals": {e.name: dict(e.residuals) for e in eng.entries},
            "rho": {e.name: {"rho1": e.rho1, "rho2": e.rho2} for e in eng.entries},
        }

    def state_dict(self):
        sd = super(self.__class__, self).state_dict()
        sd["prunex"] = dict(self._engine.state_dict(), local_steps_done=self._step_count_local)
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        engine = state_dict.pop("prunex", None)
        if engine is None:
            raise ValueError("this state dict has no 'prunex' engine state: save it with the wrapped optimizer's "
                             "state_dict()")
        super(self.__class__, self).load_state_dict(state_dict)
        self._step_count_local = int(engine.pop("local_steps_done"))
        self._engine.load_state_dict(engine)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, sparsity="channel:0.5",
                         local_steps: int = 100, rho1: float = 1.5e-3, rho2: float = 1.5e-4, rho_max: float = 10.0,
                         adaptive_rho: bool = True, weight_decay_z: float = 0.0, freeze_round: Optional[int] = None,
                         freeze_patience: int = 3, bucket_mb: float = 32, backend: str = "auto",
                         masked_retrain: bool = True, hierarchical: bool = True, coupled=False):
    """Wrap ``optimizer`` (over ``model``'s parameters) to train with H-SADMM; see the module docstring for
    the knobs. Collective: every rank constructs it, and rank 0's parameters and float buffers are broadcast
    to all. Returns an instance of the optimizer's own class with ``consensus()``, ``finalize()``,
    ``stats()`` and engine-aware ``state_dict()``/``load_state_dict()``.

    Bad input raises ``ValueError`` on every rank, naming the ranks where it was found; so do ranks that
    disagree on the model (parameter names, shapes, dtypes), the sparsity spec or any setting here."""
    def checks():
        check_wrapping(optimizer, model, bucket_mb)
        if not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(f"local_steps must be an integer >= 1, got {local_steps!r}")
        for name, value in (("rho1", rho1), ("rho2", rho2), ("rho_max", rho_max)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if coupled not in COUPLING_MODES or type(coupled) not in (bool, str):
            raise ValueError(f"coupled must be False, True (= 'pairs') or 'streams', got {coupled!r}")
        if weight_decay_z < 0:
            raise ValueError(f"weight_decay_z must be >= 0, got {weight_decay_z!r}")
        if freeze_round is not None and (not isinstance(freeze_round, int) or freeze_round < 1):
            raise ValueError(f"freeze_round must be None or an integer >= 1, got {freeze_round!r}")
        if not isinstance(freeze_patience, int) or freeze_patience < 1:
            raise ValueError(f"freeze_patience must be an integer >= 1, got {freeze_patience!r}")
        specs = resolve_specs(model.named_parameters(), sparsity)
        check_layer_types(model, specs, sparsity)   # ConvTranspose2d, grouped convs: before anything uses specs
        couplings, streams = _couplings(model, specs, coupled) if coupled else ({}, [])
        return (specs, couplings, streams), {
            "sparsity": {n: str(s) for n, s in specs.items()}, "coupled": couplings,
            "streams": [list(map(list, s)) for s in streams], "local_steps": local_steps,
            "rho": (rho1, rho2, rho_max, adaptive_rho, weight_decay_z),
            "freezing": (freeze_round, freeze_patience, masked_retrain), "bucket_mb": bucket_mb,
            "hierarchical": hierarchical}
    specs, couplings, streams = agreement.checked_construction("prunex_hvd.DistributedOptimizer", backend, model,
                                                               checks)
    if runtime.topology().rank == 0:   # every rank resolved the same specs: say it once
        warn_stages_removing_nothing(model, specs)
    return mix_into(optimizer, _DistributedOptimizer, model, specs, couplings, streams, local_steps, rho1, rho2,
                    rho_max, adaptive_rho, weight_decay_z, freeze_round, freeze_patience, bucket_mb, backend,
                    masked_retrain, hierarchical)


def _couplings(model, specs, coupled) -> Tuple[Dict[str, str], list]:
    """The conv pairs and (``coupled="streams"``) residual streams pruned as one channel group each; an error
    when coupling would change nothing, or when a stream's readers ask for different channel keep ratios."""
    pairs = {c: p for c, p in dependencies.channel_couplings(model).items()
             if c in specs and p in specs and any(k == "channel" for k, _ in specs[c].parts)}
    streams = []
    if coupled == "streams":
        for s in dependencies.channel_streams(model):
            # a member left dense, or a reader without a channel stage: that stream keeps per-layer masks
            if all(n in specs for n in s.readers + s.writers) and \
                    all(any(k == "channel" for k, _ in specs[n].parts) for n in s.readers):
                stream_keep(specs, s.readers, s.writers)   # readers' keep ratios must agree
                streams.append(s)
        if not streams:
            raise ValueError("coupled='streams', but no residual stream has only structured plain convs (groups=1) "
                             "reading and writing it, with a 'channel:K' spec on its readers: nothing to couple")
    if not pairs and not streams:
        raise ValueError("coupled=True, but no conv reads another structured conv's output alone through a "
                         "channel stage (needs a 'channel:K' spec on both, and no residual in between): "
                         "nothing to couple")
    return pairs, streams


def warn_stages_removing_nothing(model, specs) -> None:
    """One warning naming every layer where a stage of its spec can remove nothing (a glob 'channel:K' reaches
    a grayscale model's stem, which reads one channel, and depthwise convs, one channel per filter): not an
    error, but the layer stays denser than asked and saves less traffic."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n in specs}
    idle = stages_removing_nothing(shapes, specs)
    if idle:
        listed = ", ".join(f"{n} {shapes[n]}: " + "+".join(f"{k}:{dict(specs[n].parts)[k]:g}" for k in kinds)
                           for n, kinds in idle.items())
        warnings.warn(f"sparsity: these stages can remove nothing from their layers, which stay denser than asked "
                      f"(too few filters, input channels or columns for the keep ratio): {listed}", stacklevel=3)


def check_wrapping(optimizer, model, bucket_mb) -> list:
    """The checks every wrapper (PruneX and the baselines) makes before it talks to anyone: the same answer on
    every rank, so raising is safe. Returns the parameters the optimizer holds."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(bucket_mb, bool) or not (isinstance(bucket_mb, Real) and math.isfinite(bucket_mb) and bucket_mb > 0):
        raise ValueError(f"bucket_mb must be a finite number > 0, got {bucket_mb!r}")
    model_params = {id(p) for p in model.parameters()}
    stray = [i for i, g in enumerate(optimizer.param_groups) for p in g["params"] if id(p) not in model_params]
    if stray:
        raise ValueError(f"the optimizer holds parameters that are not the model's (param groups {sorted(set(stray))})")
    return [p for g in optimizer.param_groups for p in g["params"]]


def mix_into(optimizer: torch.optim.Optimizer, method_cls: type, *args, **kwargs):
    """An instance of a new class ``(method_cls's methods) + (optimizer's class)`` over the same param groups
    (as Horovod does, so schedulers and isinstance checks keep working), carrying over the optimizer's state;
    ``method_cls.__init__(self, params, *args, **kwargs)`` runs and calls ``super(self.__class__, self)``."""
    namespace: Dict[str, Any] = {}
    for klass in reversed(method_cls.__mro__):
        if klass in (object, torch.optim.Optimizer):
            continue
        namespace.update({k: v for k, v in klass.__dict__.items() if k not in ("__dict__", "__weakref__")})
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), namespace)
    wrapped = cls(optimizer.param_groups, *args, **kwargs)
    inner = optimizer.state_dict()
    if inner["state"]:
        super(cls, wrapped).load_state_dict(inner)
    return wrapped
