"""``DistributedOptimizer``: wrap any torch optimizer so training runs H-SADMM over the cluster topology.

    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                  sparsity="channel:0.5", local_steps=len(train_loader))

The knobs are :class:`prunex_hvd.ConsensusConfig`'s fields, their defaults the measured recipe, and its docstring
is the tuning guide (``help(px.ConsensusConfig)``). A config can also be passed whole, with knobs on top:
``px.DistributedOptimizer(opt, model, px.ConsensusConfig.paper(), local_steps=50)``.

What the recipe needs from the optimizer it takes from the one it wraps, and says so once on rank 0: ``rho_max``
from its lr and momentum (``rho_max="auto"``). The lr itself stays the user's, schedule and all.

* float16 / bfloat16 models train as they are: the consensus state and its arithmetic stay float32 (as AMP
  keeps master weights), what travels is in the model's dtype.
* ``finalize()`` ends training with the consensus model (z and the last round's averaged BatchNorm
  statistics) on every rank; ``consensus_weights()`` lends it for an evaluation mid-run.
* Mixed precision: ``torch.amp.GradScaler`` works as it is, Horovod's pattern too (``optimizer.synchronize()``,
  ``scaler.unscale_(optimizer)``, ``with optimizer.skip_synchronize(): scaler.step(optimizer)``). A step the
  scaler finds inf in is skipped but still counted, so rounds stay aligned across ranks (see ``step``).
* A ``torch.compile``'d model is traced through its original module, and names stay the user's. A model
  wrapped in ``DistributedDataParallel`` is refused: DDP would allreduce every gradient every step.

This module also holds what every wrapper shares (PruneX's and the baselines'): :func:`check_wrapping` and
:func:`mix_into`.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
import sys
import warnings
from typing import Any, Dict, Optional

import torch

from .dist import agreement, runtime
from .dist.comm import groups as comm_groups
from .dist.comm.base import Groups, SingleCommunicator
from .engine.config import ConsensusConfig, Structure, check_bucket_mb, round_pull_cap
from .engine import joining
from .engine.hsadmm import HSADMM
from .engine.sparsity import own_channel_layers, stages_removing_nothing


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class (as Horovod does), so schedulers and isinstance checks work."""

    records_per_epoch = False   # talks once a round: the trainer logs every round

    def __init__(self, params, model, config: ConsensusConfig, structure: Structure):
        super(self.__class__, self).__init__(params)
        self._local_steps = config.local_steps
        self._step_count_local = 0
        self._synchronized = False   # synchronize() averaged this step's gradients over the node already
        self._model, self._config, self._structure = model, config, structure
        self._last_report: Optional[dict] = None
        # elastic (prunex_hvd.elastic): the engine is made over the nodes as prunex_hvd.elastic.State.sync() forms them
        self._hsadmm = None if runtime.elastic_launch() else HSADMM(model, *self._job(), config, structure)

    def _job(self) -> tuple:
        """The topology and groups the engine runs over (PruneX (AR): one consensus group over the world)."""
        topo, groups = runtime.topology(), comm_groups(self._config.backend)
        if not self._config.hierarchical:
            topo, groups = topo.flattened(), Groups(
                world=groups.world, intra=groups.world, backend=groups.backend,
                inter=SingleCommunicator("inter", [topo.rank], [topo.node], 0) if topo.rank == 0 else None)
        return topo, groups

    @property
    def _engine(self) -> HSADMM:
        if self._hsadmm is None:
            raise RuntimeError("under horovodrun's elastic mode the optimizer trains inside a function decorated "
                               "with @prunex_hvd.elastic.run, whose State forms the nodes first")
        return self._hsadmm

    # -- elastic (prunex_hvd.elastic): no communication but in _elastic_form ---------------------------------
    def _elastic_form(self, holds: bool, anyone_holds: bool, steps: int,
                      config: Optional[ConsensusConfig] = None) -> dict:
        """Collective, on the nodes the runtime has just formed. A fresh job builds the engine (rank 0's model
        broadcast) unless construction did; a rank that ``holds`` a state goes on from it over the new nodes; a
        joining rank takes the job's settings (``config``: its round length may have been resolved over other
        ranks), builds its engine from its model and takes the job's state and step count (``steps``, the
        holders')."""
        if not holds and anyone_holds and config is not None:
            self._config, self._local_steps = config, config.local_steps
        topo, groups = self._job()
        if not anyone_holds:
            if self._hsadmm is None:   # (under torchrun construction built it)
                self._hsadmm = HSADMM(self._model, topo, groups, self._config, self._structure)
            return {"joined": [], "round": 0}
        if holds:
            joining.reform(self._hsadmm, topo, groups)
            return joining.welcome(self._hsadmm, joined=False)
        engine = joining.joiner(HSADMM, self._model, topo, groups, self._config, self._structure)
        report = joining.welcome(engine, joined=True)
        self.state.clear()   # a joiner's momentum starts at zero, as its duals do
        self._hsadmm, self._step_count_local = engine, int(steps)
        return report

    def _elastic_release(self) -> None:
        """Drop the engine's groups before the nodes change."""
        if self._hsadmm is not None:
            joining.release(self._hsadmm)

    def _elastic_snapshot(self) -> dict:
        """This rank's optimizer and engine state, copied in memory (no communication; the engine's state dict is
        a copy already)."""
        return {"optimizer": copy.deepcopy(super(self.__class__, self).state_dict()),
                "engine": self._engine.state_dict(), "steps": self._step_count_local, "config": self._config}

    def _elastic_restore(self, snapshot: dict) -> None:
        """Back to :meth:`_elastic_snapshot` (no communication; load the model's state first). The optimizer's
        state is loaded from a copy: torch's ``load_state_dict`` may keep the tensors it is given, which later steps
        change; the engine copies what it loads."""
        super(self.__class__, self).load_state_dict(copy.deepcopy(snapshot["optimizer"]))
        # the job's settings as committed (a worker torchrun restarted resolved its own over another world)
        self._config, self._local_steps = snapshot["config"], snapshot["config"].local_steps
        self._engine.config = self._config
        self._engine.load_state_dict(snapshot["engine"])
        self._step_count_local = snapshot["steps"]

    # torch.amp.GradScaler then calls step() on every iteration, inf or not, with ``grad_scale`` / ``found_inf``
    # set on the optimizer: a rank skipping a step must still count it, or the ranks' rounds drift apart
    _step_supports_amp_scaling = True
    _SCALER_STATE = ("grad_scale", "found_inf")

    def step(self, closure=None):
        """One local step: (1) with a GradScaler, unscale the gradients; (2) ``node_sync``: average them over the
        node (unless ``synchronize()`` did); (3) with a GradScaler, skip the step if a gradient is inf/NaN (with
        ``node_sync`` on any rank of the node, so the node's ranks skip together); (4) add the proximal term and
        step the user's optimizer; (5) count the step, skipped or not, and run a round every ``local_steps``."""
        if closure is not None:
            raise ValueError("prunex_hvd.DistributedOptimizer does not take a closure: the proximal term is added "
                             "to the gradients between backward() and step()")
        if self._engine.finalized:
            raise RuntimeError("step() after finalize(): finalize() ends training and leaves the consensus model "
                               "in place; to evaluate mid-run without ending it, use consensus_weights()")
        scaled = hasattr(self, "found_inf")   # GradScaler.step set it (and grad_scale) for this call
        try:
            if self._horovod_state_init():
                return super(self.__class__, self).step()
            found_inf = self._unscale() if scaled else None                              # (1)
            synced_here = not self._synchronized   # no user code between this average and the step
            if synced_here:                                                               # (2)
                self._engine.sync_node_grads(steps=self._step_count_local)
            self._synchronized = False
            if scaled and self._engine.syncs_node_grads:   # the node's mean decides, whoever averaged it
                found_inf = self._check_finite(1.0)
            loss = None
            if not (scaled and found_inf.item() > 0):                                     # (3)
                self._engine.add_proximal_grad(grads_on_structure=synced_here)            # (4)
                with self._scaler_state_hidden():
                    loss = super(self.__class__, self).step()
            self._engine.after_step()                                                     # (5)
            self._step_count_local += 1
            if self._step_count_local % self._local_steps == 0:
                self.consensus()
            return loss
        except BaseException:   # GradScaler removes its state only after a step that returned
            for k in self._SCALER_STATE:
                self.__dict__.pop(k, None)
            raise

    def _horovod_state_init(self) -> bool:
        """Whether this is ``hvd.broadcast_optimizer_state``'s first call on a fresh optimizer: it sets every
        gradient to zero and calls ``step()`` to create the state (momentum buffers). That is no training step:
        not counted, nothing averaged (every rank makes it alike)."""
        if self.state or self._step_count_local or self._engine.round:
            return False
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.requires_grad]
        return all(g is not None and not g.any() for g in grads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._synchronized = False   # synchronize() then a batch thrown away: the next gradients are new
        super(self.__class__, self).zero_grad(set_to_none)

    def _unscale(self) -> torch.Tensor:
        """The gradients divided by GradScaler's scale (when it has not unscaled them itself, ``unscale_``), and
        whether any is inf/NaN."""
        if getattr(self, "grad_scale", None) is None:   # scaler.unscale_() ran: its verdict stands
            return self.found_inf
        return self._check_finite(self.grad_scale.double().reciprocal().float())

    def _check_finite(self, inv_scale) -> torch.Tensor:
        """Multiply every gradient by ``inv_scale`` and return 1.0 if any is inf/NaN (GradScaler's own kernel, one
        call per device)."""
        by_device: Dict[torch.device, list] = {}
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    by_device.setdefault(p.grad.device, []).append(p.grad)
        found = torch.zeros((), dtype=torch.float32)
        for device, grads in by_device.items():
            here = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, here, torch.as_tensor(inv_scale, dtype=torch.float32, device=device))
            found += here.cpu()
        return found

    @contextlib.contextmanager
    def _scaler_state_hidden(self):
        """The user's optimizer steps on gradients already unscaled and checked: it must not see the scaler's
        ``grad_scale`` / ``found_inf`` (a plain SGD refuses them, a fused one would unscale again)."""
        saved = {k: self.__dict__.pop(k) for k in self._SCALER_STATE if k in self.__dict__}
        try:
            yield
        finally:
            self.__dict__.update(saved)

    def synchronize(self) -> None:
        """Horovod's ``synchronize()``: with ``node_sync``, average this step's gradients over the node now, so
        ``scaler.unscale_()`` and gradient clipping see the node's mean, as under DDP or Horovod; ``step()`` does
        not average them again. Without ``node_sync`` nothing travels per step and this does nothing."""
        if not self._synchronized:
            self._engine.sync_node_grads(steps=self._step_count_local)
            self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Horovod's context for ``step()`` after ``synchronize()``. Here ``step()`` averages the gradients only
        if ``synchronize()`` has not, with or without this context (the node's collectives must line up)."""
        yield

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

    @property
    def local_steps(self) -> int:
        """Steps per consensus round (elastic training: the job's, which a joining rank takes)."""
        return self._local_steps

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
            "cross_rack_bytes": eng.bytes["cross_rack"],
            "density": eng.density(), "layer_density": eng.layer_density(), "mask_drift": eng.state.mask_drift,
            "frozen": eng.frozen, "exchange_wait_s": eng.exchange_wait_s, "residuals": {e.name: dict(e.residuals) for e in eng.entries},
            "rho": {e.name: dict(rho1=e.rho1, rho2=e.rho2, **({"rho3": e.rho3} if eng.state.rack_tier else {}))
                    for e in eng.entries},
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
        engine = dict(engine)
        # every rank checks that the state is its own before anything is loaded; any rank's refusal is all ranks'
        agreement.call_agreed(runtime.state()[1], self._engine.state.check_owner, engine)
        super(self.__class__, self).load_state_dict(state_dict)
        self._step_count_local = int(engine.pop("local_steps_done"))
        self._engine.load_state_dict(engine)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module] = None,
                         config: Optional[ConsensusConfig] = None, *, named_parameters=None, compression=None,
                         backward_passes_per_step: int = 1, op=None, **knobs):
    """Wrap ``optimizer`` (over ``model``'s parameters) to train with H-SADMM. Collective: every rank constructs
    it, and rank 0's parameters and float buffers are broadcast to all.

    Arguments:
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        model: the ``torch.nn.Module`` being trained (PruneX traces it to find the channels to prune), or its
            ``torch.compile``'d form. Not wrapped in ``DistributedDataParallel``: PruneX synchronizes the ranks
            itself (``node_sync=True`` averages gradients within a node, as DDP would there).
        config: a :class:`ConsensusConfig` (default: its defaults); ``knobs`` are put on top of it.
        **knobs: :class:`ConsensusConfig`'s fields by name (``sparsity``, ``local_steps``, ``rho1``, ...),
            whose docstring is the tuning guide.

    Horovod's keyword arguments, so a Horovod script changes only its wrap line:
        named_parameters: accepted beside ``model`` (it must name the model's parameters), not instead of it.
        compression: ``hvd.Compression.none`` changes nothing; ``hvd.Compression.fp16`` sends the inter-node
            exchange as float16 (``payload_dtype="fp16"``; prefer ``payload_dtype="bf16"``, which cannot
            overflow). Gradients themselves never travel.
        backward_passes_per_step: accepted (an integer >= 1) and changes nothing: gradients are never reduced
            per backward pass, so accumulate as you would alone and call ``step()`` once per update;
            ``local_steps`` counts ``step()`` calls.
        op: ``hvd.Average`` (the consensus is an average of models); anything else is refused.

    Returns:
        An instance of the optimizer's own class with ``consensus()``, ``finalize()``, ``stats()``,
        ``consensus_weights()``, Horovod's ``synchronize()`` / ``skip_synchronize()`` and engine-aware
        ``state_dict()``/``load_state_dict()``.

    Bad input raises ``ValueError`` on every rank, naming the ranks where it was found; so do ranks that
    disagree on the model (parameter names, shapes, dtypes), the sparsity spec or any knob."""
    if model is None:   # the script's own call, the same on every rank: safe to raise before talking
        hint = (" named_parameters= is not enough: PruneX traces the model to find the channels it prunes,"
                if named_parameters is not None else "")
        raise ValueError(f"prunex_hvd.DistributedOptimizer needs the model:{hint} write "
                         "px.DistributedOptimizer(optimizer, model, sparsity=..., local_steps=...)")
    model = user_module(model)
    given = config if isinstance(config, ConsensusConfig) else ConsensusConfig
    backend = knobs.get("backend", given.backend)   # init() needs it before the checks below

    def checks():
        if config is not None and not isinstance(config, ConsensusConfig):
            raise ValueError(f"config must be a prunex_hvd.ConsensusConfig, got {type(config).__name__}")
        made = ConsensusConfig.from_knobs(
            horovod_arguments(model, named_parameters, compression, backward_passes_per_step, op, knobs),
            base=config)
        check_wrapping(optimizer, model, made.bucket_mb)
        made = made.with_rho_max_from(*lr_and_momentum(optimizer))
        structure = Structure.resolve(model, made)
        return (made, structure), made.agreement(structure)
    derived = knobs.get("rho_max", (config if isinstance(config, ConsensusConfig) else ConsensusConfig()).rho_max) \
        == "auto"
    if runtime.elastic_launch():   # nothing talks before prunex_hvd.elastic.run forms the nodes
        config, structure = checks()[0]
        elastic_refusal(config)
        rank = runtime.launcher_rank()
    else:
        config, structure = agreement.checked_construction("prunex_hvd.DistributedOptimizer", backend, model, checks)
        rank = runtime.topology().rank
    if rank == 0:   # every rank resolved the same specs and knobs: say it once
        warn_stages_removing_nothing(model, structure.specs)
        warn_outside_the_budget(config, structure)
        say(what_the_recipe_took(optimizer, config, derived))
    return mix_into(optimizer, _DistributedOptimizer, model, config, structure)


def elastic_refusal(config: ConsensusConfig) -> None:
    """What elastic training does not run, refused by name (the same on every rank: raised before talking)."""
    if config.overlap:
        raise ValueError("overlap=True under elastic training: a node lost with a round in flight would take the "
                         "round with it; train elastic without overlap")
    if config.rack_tier and runtime.requested_racks():
        raise ValueError("racks (nodes_per_rack) under elastic training: a lost node would leave its rack short; "
                         "train elastic on two tiers")
    if config.backend in ("horovod", "mpi"):
        raise ValueError(f"backend={config.backend!r} under elastic training: Horovod's process sets cannot "
                         "outlive a lost rank and MPI has no fault tolerance; use backend='auto' (Gloo on CPU, "
                         "NCCL on GPUs), which elastic training re-forms over the nodes left")


def lr_and_momentum(optimizer: torch.optim.Optimizer) -> tuple:
    """The lr the optimizer starts from (its first param group's; before a scheduler attached earlier changed it)
    and its heavy-ball momentum (0 for an optimizer without one)."""
    group = optimizer.param_groups[0]
    return group.get("initial_lr", group["lr"]), float(group.get("momentum", 0.0) or 0.0)


def what_the_recipe_took(optimizer, config: ConsensusConfig, derived: bool) -> str:
    """One line for rank 0: the cap of the balanced ρ's, and where it came from."""
    lr, momentum = lr_and_momentum(optimizer)
    if not derived:
        return f"DistributedOptimizer: rho balanced up to rho_max {config.rho_max:.3g}"
    cap = round_pull_cap(lr, momentum, config.local_steps)
    return (f"DistributedOptimizer: rho balanced up to rho_max {config.rho_max:.3g} "
            + (f"= (1 - momentum {momentum:g}) / (lr {lr:g} x {config.local_steps} local steps)" if config.rho_max == cap
               else f"(the starting rho: (1 - momentum {momentum:g}) / (lr {lr:g} x {config.local_steps} local steps) "
                    f"= {cap:.3g} is below it)")
            + ", from the optimizer (rho_max='auto'; a number sets it)")


def say(text: str) -> None:
    """Tell the user, once: through the ``prunex_hvd`` logger where the application set up logging, else on
    standard error (a library's info would otherwise be dropped in a script that never configured logging)."""
    logger = logging.getLogger("prunex_hvd")
    walk, configured = logger, False
    while walk is not None and not configured:
        configured = any(not isinstance(h, logging.NullHandler) for h in walk.handlers)
        walk = walk.parent if walk.propagate else None
    if configured:
        logger.info(text)
    else:
        print(f"prunex_hvd: {text}", file=sys.stderr, flush=True)


DistributedOptimizer.__signature__ = inspect.Signature(
    [inspect.Parameter("optimizer", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.optim.Optimizer),
     inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                       annotation=Optional[torch.nn.Module]),
     inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                       annotation=Optional[ConsensusConfig])]
    + [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
       for f in dataclasses.fields(ConsensusConfig)]
    + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default) for name, default in
       (("named_parameters", None), ("compression", None), ("backward_passes_per_step", 1), ("op", None))])

# Horovod's DistributedOptimizer arguments with no meaning under PruneX, and why
HOROVOD_ONLY = {
    "gradient_predivide_factor": "gradients are not reduced across ranks, so there is nothing to pre-divide",
    "num_groups": "gradients are not reduced across ranks, so there are no allreduce groups to fuse",
    "groups": "gradients are not reduced across ranks, so there are no allreduce groups to fuse",
    "sparse_as_dense": "PruneX exchanges dense parameter tensors, never sparse gradients",
    "process_set": "PruneX forms its own groups from the topology (prunex_hvd.init())",
}


def horovod_arguments(model, named_parameters, compression, backward_passes_per_step, op, knobs) -> dict:
    """Horovod's ``DistributedOptimizer`` keywords checked and turned into knobs (see
    :func:`DistributedOptimizer`); ``model`` is the module PruneX wraps (:func:`user_module`)."""
    hvd_only = sorted(set(knobs) & set(HOROVOD_ONLY))
    if hvd_only:
        raise ValueError("prunex_hvd.DistributedOptimizer does not take Horovod's "
                         + "; ".join(f"{k}= ({HOROVOD_ONLY[k]})" for k in hvd_only) + ": remove it")
    if named_parameters is not None and isinstance(model, torch.nn.Module):
        held = dict(model.named_parameters())   # a compiled model's names carry its wrapper's prefix
        foreign = [n for n, p in named_parameters if held.get(n.removeprefix("_orig_mod.")) is not p]
        if foreign:
            raise ValueError(f"named_parameters names parameters that are not the model's: {foreign[:5]}; "
                             "leave named_parameters out (PruneX reads the names from the model)")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
    if op is not None and op != _horovod_op("Average"):
        raise ValueError(f"op={op!r}: the consensus is an average of models, so only hvd.Average (the default) "
                         "has a meaning; remove op=")
    kind = getattr(compression, "__name__", type(compression).__name__)
    if compression is None or kind == "NoneCompressor":
        return knobs
    if kind != "FP16Compressor":
        raise ValueError(f"compression={kind}: PruneX takes hvd.Compression.none or hvd.Compression.fp16 (the "
                         "inter-node exchange in float16), or payload_dtype='bf16' for bfloat16")
    if knobs.get("payload_dtype", "fp16") != "fp16":
        raise ValueError(f"compression=hvd.Compression.fp16 asks for payload_dtype='fp16', but "
                         f"payload_dtype={knobs['payload_dtype']!r} was given: keep one of them")
    return dict(knobs, payload_dtype="fp16")


def _horovod_op(name: str):
    try:
        import horovod.torch as hvd
    except ImportError:   # no Horovod: no op but the default can have been meant
        return None
    return getattr(hvd, name)


def user_module(model):
    """The module PruneX traces and names parameters by: a ``torch.compile``'d model's original module (the same
    parameter tensors; names without the ``_orig_mod.`` prefix)."""
    original = getattr(model, "_orig_mod", None)
    if isinstance(original, torch.nn.Module) and type(model).__name__ == "OptimizedModule":
        return original
    return model


def refuse_data_parallel(model) -> None:
    """DDP allreduces every gradient across every rank at every ``backward()`` (FSDP also shards the
    parameters): under a wrapper that talks once a round it would silently put all that traffic back."""
    kinds = {k.__name__ for k in type(model).__mro__} & {"DistributedDataParallel", "FullyShardedDataParallel",
                                                           "FSDPModule"}
    if kinds:
        raise ValueError(f"the model is wrapped in {sorted(kinds)[0]}, which reduces every gradient across all "
                         "ranks at every backward() and would put back the traffic this wrapper removes: pass the "
                         "module itself (build it without the wrapper, or use ddp_model.module, and call that "
                         "module in the training loop). For DDP's per-step averaging within a node, use "
                         "node_sync=True")


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


def warn_outside_the_budget(config, structure) -> None:
    """With ``channel_budget="global"``, where some layers share the budget and others with a channel stage keep
    their own count (a composite spec, a coupled pair, a residual stream): one warning naming those. (Where none
    shares it, e.g. a coupled ViT, the budget changes nothing and nothing is said.)"""
    if config.channel_budget != "global":
        return
    inside = set(own_channel_layers(structure.specs, structure.couplings, structure.streams))
    outside = [n for n, spec in structure.specs.items()
               if n not in inside and {"channel", "feature"} & {kind for kind, _ in spec.parts}]
    if outside and inside:
        warnings.warn(f"channel_budget='global': {len(inside)} layers share one budget of kept weights; these keep "
                      f"their own channel count (a composite spec, a coupled pair or a residual stream): "
                      f"{', '.join(outside)}", stacklevel=3)


def check_wrapping(optimizer, model, bucket_mb=None) -> list:
    """The checks every wrapper (PruneX and the baselines) makes before it talks to anyone: the same answer on
    every rank, so raising is safe. Returns the parameters the optimizer holds."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    refuse_data_parallel(model)
    sparse = [n for n, m in model.named_modules() if getattr(m, "sparse", False) is True]
    if sparse:
        raise ValueError(f"modules with sparse gradients ({', '.join(sparse[:5])}): the wrappers exchange dense "
                         "tensors; build them with sparse=False")
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
