"""The consensus's knobs in one frozen object (:class:`ConsensusConfig`), and what they resolve to on a model
(:class:`Structure`). Each knob is spelled once, here: the wrapper's keyword arguments, the cross-rank
agreement, the engine, the training config and the command line's flags all read these fields.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Dict, List, NamedTuple, Optional, Union

import torch

from ..dist.comm import check_backend_name
from . import dependencies
from .sparsity import DENSE, StructureSpec, check_layer_types, resolve_specs, stream_keep

COUPLING_MODES = (False, True, "pairs", "streams")
PAYLOAD_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RESTARTS = ("none", "global")
CHANNEL_BUDGETS = ("layer", "global")
# rho_max="auto": the balanced ρ's stop where a round's steps would pull θ back this many times its distance to the
# consensus (ConsensusConfig.with_rho_max_from). Balancing alone raised ρ1 to a pull of 2-7 on digits' layers, where
# a round's steps mostly fight the spring (benchmarks/log/2026-11-27-rho-cap.md).
ROUND_PULL = 1.0


def round_pull_cap(lr: float, momentum: float, local_steps: int) -> float:
    """The ρ at which ``local_steps`` steps at ``lr`` with heavy-ball ``momentum`` pull θ back :data:`ROUND_PULL`
    times its distance to the consensus: pull·(1 − β)/(lr·H) (:meth:`ConsensusConfig.with_rho_max_from`)."""
    return ROUND_PULL * (1.0 - momentum) / (lr * local_steps)


def _knob(default, help: str, agree: Optional[str] = None):
    """A field with its one-line help (the command line's too); ``agree`` names the group a disagreement across
    ranks is reported under (default: the knob's own name)."""
    return field(default=default, metadata={"help": help, "agree": agree})


@dataclass(frozen=True)
class ConsensusConfig:
    """Every knob of the H-SADMM consensus, validated when it is made. ``ConsensusConfig()`` is the measured
    recipe; :meth:`paper` is the paper's round, for ablations. This docstring is the tuning guide: which knobs to
    touch, in the order to try them. The measurements behind each line are in benchmarks/log/ (benchmarks/README.md
    lists them); the levers measured and removed are in benchmarks/log/removed-knobs.md.

    Start with the defaults and two numbers of your own:

    * ``sparsity`` — the structure to keep, the fraction KEPT: ``"channel:0.5"`` (every conv keeps half of its
      input channels), ``"filter:K"``, ``"shape:K"``, stages joined with ``"+"`` (applied filter → channel →
      shape), or ``{name_glob: spec}`` per layer (``"dense"`` leaves a layer out). A transformer's linears take
      ``"head:K"`` (an attention module's heads) and ``"neuron:K"`` (an MLP's hidden units). Inter-node traffic
      and the final model shrink with the kept fraction; accuracy falls with it.
    * ``local_steps`` — wrapped ``step()`` calls between rounds. Traffic falls as 1/local_steps; longer rounds let
      the nodes drift apart. One epoch a round is where the recipe was measured: pass ``len(train_loader)``.

    Then, if the accuracy or the traffic is not what you need:

    * ``coupled`` — prune a conv's input channels together with the filters that produce them (``True``), and
      every residual stream as one channel group (``"streams"``): less traffic (~0.3–0.4× of dense on ResNets
      instead of ~0.5×) and a smaller exported model, at some accuracy. Needs a ``torch.fx``-traceable model.
    * ``channel_budget`` — ``"global"`` (default): the layers whose input channels are their own share one budget
      of kept weights, channels of largest mean squared weight first (each keeps at least a tenth); ``"layer"``:
      each keeps K of its own (the paper's). Global learns faster to the same bytes; the pruned model keeps about
      0.8 of the multiply-adds instead of 0.5.
    * ``freeze_round`` — ``0`` (default) chooses the masks from the initial weights (the same on every rank after
      the broadcast) and trains the pruned model from the first step; ``N`` freezes them after round N; ``None``
      once they hold for ``freeze_patience`` rounds. A later freeze reached the early targets later on every task
      measured and ended level: with the recipe's restart the masks keep round 1's channels anyway.
    * ``rho1`` / ``rho2`` — the pulls of each rank toward its node's consensus and of each node toward the global
      one; ``adaptive_rho`` (default) balances them per layer by the residuals, up to ``rho_max``. ``rho_max="auto"``
      (default) caps them where a round's steps would pull θ back once its distance to the consensus:
      (1 − momentum)/(lr · local_steps) from the wrapped optimizer, logged on rank 0. A higher cap damps the
      global model's moves; a lower one frees the nodes.
    * ``payload_dtype`` — ``"bf16"`` (default) sends each leader's change since what it last sent, in bfloat16,
      and one round in 128 whole in float32 (docs/algorithm.md, "A narrow inter-node payload"): about half of
      float32's inter-node bytes. ``None``: the model's dtype; ``"fp16"`` can overflow (the round is then
      refused, named).
    * ``overlap`` — hide the inter-node exchange behind the next round's first local steps: ``True`` folds it in
      after a quarter of a round, ``N`` after N steps (fold after the fewest steps that cover the exchange). On
      where the exchange is a large share of a round (a slow link); off by default.

    The lr is yours, as your script sets it (Horovod's lr × size included): in a Horovod user's script with only the
    wrap line changed (``examples/horovod_mnist.py``, 8 seeds), the recipe ended 0.56 points below
    ``hvd.DistributedOptimizer``, the paper's round 1.60 below; a lr warm-up over the first rounds or the node's
    linearly scaled lr only cost it more (2.3 and 7.9 points; benchmarks/log/2026-12-01-dropin.md). A
    deep model at a high lr may diverge in its first rounds, when each node steps alone on its node's batch
    (ResNet-18 at lr 0.05, a node batch of 32): warm its lr up over the first two epochs, as ``prunex-hvd
    train`` does for PruneX.

    What the recipe fixes, and why you rarely change it:

    * ``restart="global"`` starts every round's local steps at the new consensus z, as local SGD restarts from
      the average (``"none"``: where the steps left θ, the paper's round; slower on every task measured).
    * ``node_sync=True`` averages the gradients over a node's ranks every step (its fast links), so each node
      trains as one data-parallel worker and H-SADMM agrees between nodes; z_i still mixes the node's θ + u with
      z − v_i, and u stays a dual (docs/algorithm.md).
    * ``hierarchical=False`` is the paper's "PruneX (AR)" ablation: one flat consensus over the world (every rank
      sends its dense θ + u); it has no node tier, so ``node_sync``, ``payload_dtype`` and ``overlap`` are off
      with it (:meth:`paper` gives such a config: ``ConsensusConfig.paper(hierarchical=False)``).
    * ``rack_tier`` / ``rho3`` — with racks (``nodes_per_rack``, or Slurm's switches) a consensus per rack sits
      between the nodes' and the global one, and only rack leaders cross the spine (0.68× its bytes on 2 × 2
      hosts); ``rho3`` is the racks' pull toward z (None: ``rho2``). Not with ``overlap``.
    * ``bucket_mb`` — the flat buffers of one collective; ``backend`` — ``auto`` (nccl for CUDA tensors, mpi under
      MPI, gloo otherwise), ``mpi``, ``gloo``, ``nccl`` or ``horovod``.

    Frozen: change a copy with :func:`dataclasses.replace`, which validates again.
    """
    sparsity: Any = _knob("channel:0.5", "channel:0.5, filter:0.5+channel:0.5, head:0.5+neuron:0.5 (a ViT), or "
                                         "JSON {glob: spec}; the number is the KEPT fraction")
    local_steps: int = _knob(100, "wrapped steps between consensus rounds")
    rho1: float = _knob(0.01, "pull of each rank toward its node's consensus z_i", agree="rho")
    rho2: float = _knob(0.001, "pull of each node toward the global consensus z", agree="rho")
    rho3: Optional[float] = _knob(None, "with racks: pull of each rack's consensus toward the global z (None: "
                                        "rho2)", agree="rho")
    rho_max: Union[float, str] = _knob("auto", "cap of the balanced rho's: a number, or auto: (1 - momentum) / (lr "
                                               "x local_steps) from the wrapped optimizer", agree="rho")
    adaptive_rho: bool = _knob(True, "balance primal and dual residuals per layer by rescaling rho", agree="rho")
    freeze_round: Optional[int] = _knob(0, "round after which masks freeze (0: chosen from the initial weights "
                                           "before the first step; None: once they hold freeze_patience rounds)",
                                        agree="freezing")
    freeze_patience: int = _knob(3, "with freeze_round=None: rounds the global mask must hold before it freezes",
                                 agree="freezing")
    coupled: Union[bool, str] = _knob(False, "channel pruning with dependencies: True (= 'pairs') or 'streams'")
    channel_budget: str = _knob("global", "how channel:K is counted: global (one budget of kept weights over the "
                                          "layers whose channels are their own) or layer (each keeps K)",
                                agree="freezing")
    bucket_mb: float = _knob(32.0, "size of the flat buffers packed for one collective (MB)")
    backend: str = _knob("auto", "auto, mpi, gloo, nccl or horovod")
    hierarchical: bool = _knob(True, "False: one flat consensus over the world group (PruneX (AR))")
    restart: str = _knob("global", "where θ starts each round's local steps: global (the new z) or none (where "
                                   "its steps left it: the paper's round)", agree="round")
    node_sync: bool = _knob(True, "average gradients over the node's ranks before every step (fast links): each "
                                  "node trains as one data-parallel worker", agree="round")
    payload_dtype: Optional[str] = _knob("bf16", "what the inter-node exchange carries: bf16 / fp16 (each "
                                                 "leader's change since what it sent; one round in 128 whole, in "
                                                 "float32), fp32, or None (the model's dtype)", agree="round")
    overlap: Union[bool, int] = _knob(False, "leave each round's inter-node exchange in flight during the next "
                                             "round's first steps: True (a quarter of a round) or N steps",
                                      agree="round")
    rack_tier: bool = _knob(True, "with racks (nodes_per_rack, more than one rack): a consensus per rack between the "
                                  "nodes' and the global one (three tiers); off: two tiers over all nodes",
                            agree="round")

    # what the paper's round (Algorithm 1 with the defaults of its Sec. 5) sets where the recipe differs
    PAPER = dict(rho1=1.5e-3, rho2=1.5e-4, rho_max=10.0, freeze_round=None, channel_budget="layer", restart="none",
                 node_sync=False, payload_dtype=None)

    @classmethod
    def paper(cls, **knobs) -> "ConsensusConfig":
        """The paper's round: ρ1 = 1.5e-3, ρ2 = 1.5e-4 balanced up to 10, masks projected every round until they
        hold ``freeze_patience`` rounds, each layer its own channel count, θ left where its steps took it, every
        rank stepping alone between rounds, z in the model's dtype; ``knobs`` on top."""
        return cls(**dict(cls.PAPER, **knobs))

    def __post_init__(self):
        def integer(name, minimum, optional=False):
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be {'None or ' if optional else ''}an integer >= {minimum}, "
                                 f"got {value!r}")

        def positive(name, value):
            if isinstance(value, bool) or not (isinstance(value, Real) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        integer("local_steps", 1)
        for name in ("rho1", "rho2") + (("rho3",) if self.rho3 is not None else ()):
            positive(name, getattr(self, name))
        if self.rho_max != "auto":
            positive("rho_max", self.rho_max)
        for name in ("adaptive_rho", "hierarchical", "node_sync", "rack_tier"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.coupled not in COUPLING_MODES or type(self.coupled) not in (bool, str):
            raise ValueError(f"coupled must be False, True (= 'pairs') or 'streams', got {self.coupled!r}")
        if self.channel_budget not in CHANNEL_BUDGETS:
            raise ValueError(f"channel_budget must be one of {', '.join(CHANNEL_BUDGETS)}, got {self.channel_budget!r}")
        integer("freeze_round", 0, optional=True)
        integer("freeze_patience", 1)
        if self.restart not in RESTARTS:
            raise ValueError(f"restart must be one of {', '.join(RESTARTS)}, got {self.restart!r}")
        if self.payload_dtype not in PAYLOAD_DTYPES:
            raise ValueError(f"payload_dtype must be None, 'fp32', 'bf16' or 'fp16', got {self.payload_dtype!r}")
        if not isinstance(self.overlap, bool) and (not isinstance(self.overlap, int) or self.overlap < 1):
            raise ValueError(f"overlap must be True, False or a number of steps >= 1, got {self.overlap!r}")
        check_bucket_mb(self.bucket_mb)
        check_backend_name(self.backend)
        for refused, why in REFUSED:
            if refused(self):
                raise ValueError(why(self))

    def with_rho_max_from(self, lr: float, momentum: float = 0.0) -> "ConsensusConfig":
        """This config with ``rho_max="auto"`` resolved for an optimizer at ``lr`` with heavy-ball ``momentum`` β:
        the ρ at which a round's ``local_steps`` steps, under the proximal term alone, would pull θ back
        :data:`ROUND_PULL` times its distance to the consensus. A steady force F moves θ by lr·F/(1 − β) a step,
        so H steps at ρ pull back H·lr·ρ/(1 − β) of the distance: ρ_max = pull·(1 − β)/(lr·H), never below the
        ρ's the run starts from. A number already set is kept."""
        if self.rho_max != "auto":
            return self
        if not (isinstance(lr, Real) and math.isfinite(lr) and lr > 0) or not 0 <= momentum < 1:
            raise ValueError(f"rho_max='auto' is (1 - momentum) / (lr x local_steps), which needs lr > 0 and "
                             f"0 <= momentum < 1 (got lr {lr!r}, momentum {momentum!r}): set rho_max to a number")
        cap = round_pull_cap(lr, momentum, self.local_steps)
        return dataclasses.replace(self, rho_max=max(cap, self.rho1, self.rho2, self.rho3 or 0.0))

    @property
    def overlap_steps(self) -> Optional[int]:
        """The local steps after which an overlapped round is folded in (None: rounds do not overlap)."""
        if self.overlap is False:
            return None
        return max(1, self.local_steps // 4) if self.overlap is True else int(self.overlap)

    @classmethod
    def knob_names(cls) -> List[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_knobs(cls, knobs: Dict[str, Any], base: Optional["ConsensusConfig"] = None,
                   who: str = "DistributedOptimizer") -> "ConsensusConfig":
        """``base`` (default: the defaults) with ``knobs`` in place. An unknown name is a ``ValueError`` (as a
        bad value is, so the wrapper's agreement raises it on every rank) that says which knob was meant."""
        names = cls.knob_names()
        for name in knobs:
            if name not in names:
                near = difflib.get_close_matches(name, names, n=1)
                raise ValueError(f"{who}() got an unexpected keyword argument {name!r}"
                                + (f" (did you mean {near[0]!r}?)" if near else "")
                                + f"; its knobs are {', '.join(names)}")
        return dataclasses.replace(base, **knobs) if base is not None else cls(**knobs)

    def knobs(self) -> Dict[str, Any]:
        """``{name: value}`` of every knob (the values themselves, not copies)."""
        return {name: getattr(self, name) for name in self.knob_names()}

    def agreement(self, structure: "Structure") -> Dict[str, Any]:
        """What every rank must hold equal: every knob, with ``sparsity`` and ``coupled`` replaced by what they
        resolved to on this model (``structure``), grouped as a disagreement is reported (``rho`` for the
        ρ's, ``freezing``, ...; a knob without a group under its own name)."""
        resolved = {"sparsity": ({n: str(s) for n, s in structure.specs.items()}, [g.module for g in structure.heads]),
                    "coupled": (structure.couplings, [list(map(list, s)) for s in structure.streams])}
        out: Dict[str, list] = {}
        for f in dataclasses.fields(self):
            out.setdefault(f.metadata["agree"] or f.name, []).append(resolved.get(f.name, getattr(self, f.name)))
        return {k: v[0] if len(v) == 1 else tuple(v) for k, v in out.items()}


# The combinations refused, each as (refused?, why): the only ones. (The engine refuses one more, which needs the
# topology: overlap with the rack tier.)
REFUSED = (
    (lambda c: not c.hierarchical and (c.node_sync or c.payload_dtype is not None or c.overlap is not False),
     lambda c: "hierarchical=False is one flat consensus over the world, with no node tier for "
               + ", ".join(k for k, on in (("node_sync=True", c.node_sync),
                                          (f"payload_dtype={c.payload_dtype!r}", c.payload_dtype is not None),
                                          (f"overlap={c.overlap!r}", c.overlap is not False)) if on)
               + " to act on: turn it off (ConsensusConfig.paper(hierarchical=False) is the paper's flat round)"),
)


def check_bucket_mb(bucket_mb) -> None:
    if isinstance(bucket_mb, bool) or not (isinstance(bucket_mb, Real) and math.isfinite(bucket_mb) and bucket_mb > 0):
        raise ValueError(f"bucket_mb must be a finite number > 0, got {bucket_mb!r}")


class Structure(NamedTuple):
    """What ``sparsity`` and ``coupled`` mean on one model: the spec of every structured parameter, the pairs
    ``{consumer: producer}`` (convs, MLP linears) and residual streams pruned as one channel group each, and the
    attention modules whose heads are pruned (:class:`~prunex_hvd.engine.dependencies.HeadGroup`)."""
    specs: Dict[str, StructureSpec]
    couplings: Dict[str, str]
    streams: list
    heads: tuple = ()

    @classmethod
    def resolve(cls, model: torch.nn.Module, config: ConsensusConfig) -> "Structure":
        """Raises ``ValueError`` for a spec that does not fit the model (a glob matching nothing, a layer type
        the GEMM view does not fit, coupling that would change nothing, stream readers asking for different
        keep ratios, an attention module's weights asking for different heads)."""
        targets = dependencies.structure_targets(model)
        specs = resolve_specs(model.named_parameters(), config.sparsity, targets)
        check_layer_types(model, specs, config.sparsity)   # before anything uses specs
        couplings, streams = _couplings(model, specs, config.coupled) if config.coupled else ({}, [])
        heads = tuple(g for g in targets.heads if g.members[0] in specs)
        return cls(specs, couplings, streams, heads)


def _couplings(model, specs, coupled):
    """The pairs and (``coupled="streams"``) residual streams pruned as one channel group each; an error
    when coupling would change nothing, or when a stream's readers ask for different channel keep ratios.
    An MLP pair whose hidden layer has ``neuron:K`` and whose reader has no ``feature`` stage becomes one
    group of hidden units: the reader takes ``feature:K`` (in ``specs``, which this updates)."""
    pairs = {}
    for c, p in dependencies.channel_couplings(model).items():
        hidden = specs[p].keep("neuron") if p in specs else None
        if hidden is not None and specs.get(c, DENSE).keep("feature") is None:
            specs[c] = StructureSpec(specs.get(c, DENSE).parts + (("feature", hidden),))
        if c in specs and p in specs and any(k in ("channel", "feature") for k, _ in specs[c].parts):
            pairs[c] = p
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
                         "channel stage (needs a 'channel:K' spec on both, and no residual in between), and no "
                         "MLP has 'neuron:K' or 'feature:K': nothing to couple")
    return pairs, streams
