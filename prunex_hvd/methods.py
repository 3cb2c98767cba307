"""The ``--method`` switch of ``prunex-hvd train``: each method wraps the user's optimizer in one call.

Every wrapped optimizer is an instance of the user's optimizer class and also offers what the trainer needs,
so the same loop, sampler, metrics and byte counters serve every method:

* ``stats()`` with at least :data:`STATS_KEYS` (``rounds`` counts communication rounds; methods that talk
  every step count steps), and ``rounds_done()``, the same count, cheap enough for every step;
* ``consensus_weights()``: a context manager during which the model holds the weights to evaluate (for
  PruneX the global consensus z, i.e. the pruned model so far);
* ``finalize()``: leave the final model in place, identical on every rank;
* ``state_dict()`` / ``load_state_dict()`` including the method's own state.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

STATS_KEYS = ("rounds", "steps", "inter_bytes", "intra_bytes", "dense_inter_bytes", "density")


def _prunex(optimizer: torch.optim.Optimizer, model: torch.nn.Module, cfg, local_steps: int, sample_batch,
            hierarchical: bool = True):
    from .optimizer import DistributedOptimizer
    return DistributedOptimizer(optimizer, model, sparsity=cfg.sparsity, local_steps=local_steps, rho1=cfg.rho1,
                                rho2=cfg.rho2, rho_max=cfg.rho_max, adaptive_rho=cfg.adaptive_rho,
                                weight_decay_z=cfg.weight_decay_z, freeze_round=cfg.freeze_round,
                                freeze_patience=cfg.freeze_patience, bucket_mb=cfg.bucket_mb, backend=cfg.backend,
                                masked_retrain=cfg.masked_retrain, coupled=cfg.coupled, hierarchical=hierarchical)


def _prunex_flat(optimizer, model, cfg, local_steps: int, sample_batch):
    return _prunex(optimizer, model, cfg, local_steps, sample_batch, hierarchical=False)


def _dense(optimizer, model, cfg, local_steps: int, sample_batch):
    from .baselines import dense
    return dense.DistributedOptimizer(optimizer, model, bucket_mb=cfg.bucket_mb, backend=cfg.backend)


def _topk(optimizer, model, cfg, local_steps: int, sample_batch):
    from .baselines import topk
    return topk.DistributedOptimizer(optimizer, model, ratio=cfg.topk_ratio, warmup_steps=cfg.topk_warmup_steps,
                                     bucket_mb=cfg.bucket_mb, backend=cfg.backend)


def _pactrain(optimizer, model, cfg, local_steps: int, sample_batch):
    from .baselines import pactrain
    return pactrain.DistributedOptimizer(optimizer, model, sparsity=cfg.sparsity, score=cfg.pactrain_score,
                                         patience=cfg.pactrain_patience, terngrad=cfg.terngrad,
                                         bucket_mb=cfg.bucket_mb, backend=cfg.backend, seed=cfg.seed,
                                         grasp_batch=sample_batch() if cfg.pactrain_score == "grasp" else None)


METHODS: Dict[str, Callable] = {"dense": _dense, "topk": _topk, "pactrain": _pactrain, "prunex-flat": _prunex_flat,
                                "prunex": _prunex}


def wrap(name: str, optimizer: torch.optim.Optimizer, model: torch.nn.Module, cfg, local_steps: int,
         sample_batch: Callable = None):
    """Wrap ``optimizer`` for method ``name`` (collective: every rank calls it with the same arguments).
    ``sample_batch()`` gives one training batch (x, y), for methods that score weights on data (GraSP)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return METHODS[name](optimizer, model, cfg, local_steps, sample_batch)
