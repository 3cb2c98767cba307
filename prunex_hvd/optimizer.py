"""``DistributedOptimizer``: wrap any torch optimizer so training runs H-SADMM over the cluster topology.

    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), model,
                                  sparsity="channel:0.5", local_steps=100)

The knobs are :class:`prunex_hvd.ConsensusConfig`'s fields, and its docstring is the tuning guide
(``help(px.ConsensusConfig)``). A config can also be passed whole, with knobs on top:
``px.DistributedOptimizer(opt, model, config, local_steps=50)``.

* float16 / bfloat16 models train as they are: the consensus state and its arithmetic stay float32 (as AMP
  keeps master weights), what travels is in the model's dtype.
* ``finalize()`` ends training with the consensus model (z and the last round's averaged BatchNorm
  statistics) on every rank; ``consensus_weights()`` lends it for an evaluation mid-run.

This module also holds what every wrapper shares (PruneX's and the baselines'): :func:`check_wrapping` and
:func:`mix_into`.
"""
from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, Dict, Optional

import torch

from .dist import agreement, runtime
from .dist.comm import groups as comm_groups
from .dist.comm.base import Groups, SingleCommunicator
from .engine.config import ConsensusConfig, Structure, check_bucket_mb
from .engine.hsadmm import HSADMM
from .engine.sparsity import stages_removing_nothing


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class (as Horovod does), so schedulers and isinstance checks work."""

    records_per_epoch = False   # talks once a round: the trainer logs every round

    def __init__(self, params, model, config: ConsensusConfig, structure: Structure):
        super(self.__class__, self).__init__(params)
        topo = runtime.topology()
        self._local_steps = config.local_steps
        self._step_count_local = 0
        groups = comm_groups(config.backend)
        if not config.hierarchical:   # PruneX (AR): one consensus group over the world, no leaders' tier
            topo, groups = topo.flattened(), Groups(
                world=groups.world, intra=groups.world, backend=groups.backend,
                inter=SingleCommunicator("inter", [topo.rank], [topo.node], 0) if topo.rank == 0 else None)
        self._engine = HSADMM(model, topo, groups, config, structure)
        self._last_report: Optional[dict] = None

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("prunex_hvd.DistributedOptimizer does not take a closure: the proximal term is added "
                             "to the gradients between backward() and step()")
        if self._engine.finalized:
            raise RuntimeError("step() after finalize(): finalize() ends training and leaves the consensus model "
                               "in place; to evaluate mid-run without ending it, use consensus_weights()")
        self._engine.sync_node_grads()
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

    def complete(self) -> None:
        """``overlap``: fold in the round whose inter-node exchange is in flight now (collective), so that
        ``consensus_weights()`` and ``stats()`` include it. Not needed in a training loop: the next round folds it
        in, and ``finalize()`` does."""
        self._engine.complete()

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
            "frozen": eng.frozen, "exchange_wait_s": eng.exchange_wait_s, "residuals": {e.name: dict(e.residuals) for e in eng.entries},
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


def DistributedOptimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                         config: Optional[ConsensusConfig] = None, **knobs):
    """Wrap ``optimizer`` (over ``model``'s parameters) to train with H-SADMM. Collective: every rank constructs
    it, and rank 0's parameters and float buffers are broadcast to all.

    Arguments:
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        model: the ``torch.nn.Module`` being trained.
        config: a :class:`ConsensusConfig` (default: its defaults); ``knobs`` are put on top of it.
        **knobs: :class:`ConsensusConfig`'s fields by name (``sparsity``, ``local_steps``, ``rho1``, ...),
            whose docstring is the tuning guide.

    Returns:
        An instance of the optimizer's own class with ``consensus()``, ``finalize()``, ``stats()``,
        ``consensus_weights()`` and engine-aware ``state_dict()``/``load_state_dict()``.

    Bad input raises ``ValueError`` on every rank, naming the ranks where it was found; so do ranks that
    disagree on the model (parameter names, shapes, dtypes), the sparsity spec or any knob."""
    given = config if isinstance(config, ConsensusConfig) else ConsensusConfig
    backend = knobs.get("backend", given.backend)   # init() needs it before the checks below

    def checks():
        if config is not None and not isinstance(config, ConsensusConfig):
            raise ValueError(f"config must be a prunex_hvd.ConsensusConfig, got {type(config).__name__}")
        made = ConsensusConfig.from_knobs(knobs, base=config)
        check_wrapping(optimizer, model, made.bucket_mb)
        structure = Structure.resolve(model, made)
        return (made, structure), made.agreement(structure)
    config, structure = agreement.checked_construction("prunex_hvd.DistributedOptimizer", backend, model, checks)
    if runtime.topology().rank == 0:   # every rank resolved the same specs: say it once
        warn_stages_removing_nothing(model, structure.specs)
    return mix_into(optimizer, _DistributedOptimizer, model, config, structure)


DistributedOptimizer.__signature__ = inspect.Signature(
    [inspect.Parameter("optimizer", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.optim.Optimizer),
     inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.nn.Module),
     inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                       annotation=Optional[ConsensusConfig])]
    + [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
       for f in dataclasses.fields(ConsensusConfig)])


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


def check_wrapping(optimizer, model, bucket_mb=None) -> list:
    """The checks every wrapper (PruneX and the baselines) makes before it talks to anyone: the same answer on
    every rank, so raising is safe. Returns the parameters the optimizer holds."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if bucket_mb is not None:   # methods without buckets pass none
        check_bucket_mb(bucket_mb)
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
