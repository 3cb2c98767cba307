"""The ``--method`` switch of ``prunex-hvd train``: each method wraps the user's optimizer in one call.

Every wrapped optimizer is an instance of the user's optimizer class and also offers what the trainer needs,
so the same loop, sampler, metrics and byte counters serve every method:

* ``stats()`` with at least :data:`STATS_KEYS` (``rounds`` counts communication rounds; methods that talk
  every step count steps), and ``rounds_done()``, the same count, cheap enough for every step;
* ``consensus_weights()``: a context manager during which the model holds the weights to evaluate (for
  PruneX the global consensus z, i.e. the pruned model so far);
* ``finalize()``: leave the final model in place, identical on every rank;
* ``state_dict()`` / ``load_state_dict()`` including the method's own state.

:class:`Method` spells that contract as a ``typing.Protocol``; :func:`wrap` checks every method against it.
"""
from __future__ import annotations

from typing import Callable, ContextManager, Dict, Optional, Protocol, runtime_checkable

import torch

STATS_KEYS = ("rounds", "steps", "inter_bytes", "intra_bytes", "dense_inter_bytes", "density")


@runtime_checkable
class Method(Protocol):
    """What the trainer needs of a wrapped optimizer, besides the optimizer's own ``step`` and ``zero_grad``."""

    records_per_epoch: bool   # talks every step: log once an epoch, not every round

    def stats(self) -> dict:
        """At least :data:`STATS_KEYS`."""

    def rounds_done(self) -> int:
        """Communication rounds so far (steps for methods that talk every step); cheap."""

    def consensus(self) -> Optional[dict]:
        """Bring the steps since the last round into the model to finalize (a round now); None where every
        step already communicates."""

    def consensus_weights(self) -> ContextManager:
        """A context in which the model holds the weights to evaluate, the same on every rank."""

    def finalize(self) -> None:
        """Leave the final model in place, identical on every rank."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


# the contract's member names, for saying which ones a method lacks
_MEMBERS = tuple(Method.__annotations__) + tuple(n for n, v in vars(Method).items()
                                                 if callable(v) and not n.startswith("_"))


def _prunex(optimizer: torch.optim.Optimizer, model: torch.nn.Module, cfg, sample_batch, hierarchical: bool = True):
    from ..optimizer import DistributedOptimizer
    # one flat group has no node to sync within and no inter-node exchange: the recipe's node_sync,
    # payload_dtype and overlap do not apply to the ablation
    return DistributedOptimizer(optimizer, model, cfg.consensus, hierarchical=hierarchical,
                                node_sync=hierarchical and cfg.consensus.node_sync,
                                payload_dtype=cfg.consensus.payload_dtype if hierarchical else None,
                                overlap=hierarchical and cfg.consensus.overlap)


def _prunex_flat(optimizer, model, cfg, sample_batch):
    return _prunex(optimizer, model, cfg, sample_batch, hierarchical=False)


def _dense(optimizer, model, cfg, sample_batch):
    from ..baselines import dense
    c = cfg.consensus
    return dense.DistributedOptimizer(optimizer, model, bucket_mb=c.bucket_mb, backend=c.backend)


def _topk(optimizer, model, cfg, sample_batch):
    from ..baselines import topk
    c = cfg.consensus
    return topk.DistributedOptimizer(optimizer, model, ratio=cfg.topk_ratio, warmup_steps=cfg.topk_warmup_steps,
                                     bucket_mb=c.bucket_mb, backend=c.backend)


def _pactrain(optimizer, model, cfg, sample_batch):
    from ..baselines import pactrain
    c = cfg.consensus
    return pactrain.DistributedOptimizer(optimizer, model, sparsity=c.sparsity, score=cfg.pactrain_score,
                                         patience=cfg.pactrain_patience, terngrad=cfg.terngrad,
                                         bucket_mb=c.bucket_mb, backend=c.backend, seed=cfg.seed,
                                         grasp_batch=sample_batch() if cfg.pactrain_score == "grasp" else None,
                                         structure=cfg.pactrain_structure,
                                         coupled=c.coupled)


def _localsgd(optimizer, model, cfg, sample_batch):
    from ..baselines import averaging
    return averaging.LocalSGD(optimizer, model, period=cfg.consensus.local_steps, backend=cfg.consensus.backend)


def _localsgd_hier(optimizer, model, cfg, sample_batch):
    from ..baselines import averaging
    return averaging.HierarchicalLocalSGD(optimizer, model, period=cfg.consensus.local_steps,
                                          intra_period=cfg.hier_intra_steps, backend=cfg.consensus.backend)


def _diloco(optimizer, model, cfg, sample_batch):
    from ..baselines import averaging
    return averaging.DiLoCo(optimizer, model, period=cfg.consensus.local_steps, outer_lr=cfg.diloco_outer_lr,
                            outer_momentum=cfg.diloco_outer_momentum, backend=cfg.consensus.backend)


# the round-based methods take their period from the consensus's local_steps (--local-steps / --local-epochs)
METHODS: Dict[str, Callable] = {"dense": _dense, "topk": _topk, "pactrain": _pactrain, "localsgd": _localsgd,
                                "localsgd-hier": _localsgd_hier, "diloco": _diloco, "prunex-flat": _prunex_flat,
                                "prunex": _prunex}


# The settings only some methods read: {setting: those methods}. The data, the schedule and the launch apply to
# every method (a method that talks every step takes no period from --local-steps, but logs by it).
PRUNEX_METHODS = ("prunex", "prunex-flat")       # the consensus methods
PRUNING_METHODS = PRUNEX_METHODS + ("pactrain",)   # the methods whose final model is pruned
ONLY_FOR: Dict[str, tuple] = {
    **dict.fromkeys(("rho1", "rho2", "rho_max", "freeze_round", "channel_budget", "paper"), PRUNEX_METHODS),
    **dict.fromkeys(("node_sync", "payload_dtype", "overlap"), ("prunex",)),   # the node tier: not the flat one
    **dict.fromkeys(("sparsity", "coupled"), PRUNING_METHODS),
    "elastic": PRUNEX_METHODS,
    "topk_ratio": ("topk",), "pactrain_structure": ("pactrain",), "hier_intra_steps": ("localsgd-hier",),
}


def wrap(name: str, optimizer: torch.optim.Optimizer, model: torch.nn.Module, cfg, sample_batch: Callable = None):
    """Wrap ``optimizer`` for method ``name`` (collective: every rank calls it with the same arguments).

    Arguments:
        cfg: the run's :class:`~prunex_hvd.app.train.TrainConfig`, its schedule resolved (the consensus's
            ``local_steps`` and ``freeze_round`` in steps and rounds: ``TrainConfig.resolved``).
        sample_batch: gives one training batch (x, y), for methods that score weights on data (GraSP)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    opt = METHODS[name](optimizer, model, cfg, sample_batch)
    if not isinstance(opt, Method):   # the same on every rank: a programming error, not a user's
        missing = [a for a in _MEMBERS if not hasattr(opt, a)]
        raise TypeError(f"method {name!r} does not offer what the trainer needs: {missing}")
    return opt
