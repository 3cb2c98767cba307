"""Sparsity specs: which structure each weight is held to, parsed and checked before training starts.

Conv weights (4-D): ``"filter:K"``, ``"channel:K"``, ``"shape:K"``; linear weights (2-D): ``"neuron:K"`` (rows),
``"feature:K"`` (input columns); attention: ``"head:K"`` (K = fraction of groups KEPT). Parts are joined with
``"+"`` and applied filter → channel → shape, neuron → feature; each weight takes the parts of its kind. Or
``{name_glob: spec}`` per layer (:func:`resolve_specs`). What each kind keeps, and how a spec becomes masks, is
in :mod:`prunex_hvd.engine.sparsity` (the package docstring). Pure functions, no tensors moved, no
communication.
"""
from __future__ import annotations

import difflib
import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional, Tuple

import torch

KINDS = ("filter", "channel", "shape", "neuron", "feature", "head")   # also the application order
CONV_KINDS = ("filter", "channel", "shape")   # on 4-D conv weights
LINEAR_KINDS = ("neuron", "feature")           # on 2-D linear weights: rows, input columns
HEAD_KINDS = ("head",)                         # on an attention module's heads, one group over its weights
_ORDER = {k: i for i, k in enumerate(KINDS)}
_DENSE_WORDS = ("", "dense")


# --------------------------------------------------------------------------------------------- specs

def _fmt_keep(keep: float) -> str:
    # Short form when it round-trips ("0.5", "1"), exact repr otherwise, so str(spec) parses back equal.
    s = f"{keep:.12g}"
    return s if float(s) == keep else repr(keep)


def _unknown_kind(kind: str) -> str:
    """What to say of a structure kind that is none of :data:`KINDS`: the closest one, if any is close."""
    close = difflib.get_close_matches(kind, KINDS, n=1)
    return f"unknown structure kind {kind!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def _check_part(kind, keep) -> Tuple[str, float]:
    if kind not in _ORDER:
        raise ValueError(f"{_unknown_kind(kind)}; valid kinds: {', '.join(KINDS)}")
    try:
        keep = float(keep)
    except (TypeError, ValueError):
        raise ValueError(f"{kind}: keep ratio {keep!r} is not a number") from None
    if not (0.0 < keep <= 1.0):     # also rejects nan
        raise ValueError(f"{kind}:{keep!r}: keep ratio must be in (0, 1]")
    return kind, keep


@dataclass(frozen=True)
class StructureSpec:
    """A structured-sparsity constraint: ``(kind, keep)`` pairs in application order; ``()`` is dense.

    Built by :func:`parse_spec`; direct construction is validated and put in canonical order too, so two
    specs meaning the same thing compare (and hash) equal.
    """
    parts: tuple = ()

    def __post_init__(self):
        parts = [_check_part(*p) for p in self.parts]
        kinds = [k for k, _ in parts]
        for k in KINDS:
            if kinds.count(k) > 1:
                raise ValueError(f"structure kind {k!r} given more than once")
        object.__setattr__(self, "parts", tuple(sorted(parts, key=lambda p: _ORDER[p[0]])))

    @property
    def is_dense(self) -> bool:
        """No constraint at all: every entry is kept."""
        return not self.parts

    def __str__(self) -> str:
        if self.is_dense:
            return "dense"
        return "+".join(f"{k}:{_fmt_keep(v)}" for k, v in self.parts)

    def only(self, kinds) -> "StructureSpec":
        """The parts whose kind is in ``kinds`` (what one kind of weight takes of a mixed spec)."""
        return StructureSpec(tuple(p for p in self.parts if p[0] in kinds))

    def keep(self, kind: str) -> Optional[float]:
        """The keep ratio of ``kind``, or None without that stage."""
        return next((k for name, k in self.parts if name == kind), None)


DENSE = StructureSpec(())


def parse_spec(spec) -> StructureSpec:
    """``"filter:0.3+shape:0.8"`` → :class:`StructureSpec`, parts in the order filter → channel → shape.

    ``None``, ``""`` and ``"dense"`` mean no constraint; a :class:`StructureSpec` is returned as is.
    Whitespace and letter case are ignored. The number is the fraction of groups *kept*, in (0, 1].
    """
    if isinstance(spec, StructureSpec):
        return spec
    if spec is None:
        return DENSE
    if not isinstance(spec, str):
        raise TypeError(f"sparsity spec must be a str like 'channel:0.5', a StructureSpec or None, "
                        f"not {type(spec).__name__}")
    text = "".join(spec.split()).lower()
    if text in _DENSE_WORDS:
        return DENSE
    parts = []
    for item in text.split("+"):
        kind, sep, num = item.partition(":")
        if not item:
            raise ValueError(f"sparsity spec {spec!r}: an empty part (parts are joined by '+', e.g. "
                             f"'filter:0.5+channel:0.5')")
        if kind not in _ORDER:
            raise ValueError(f"sparsity spec {spec!r}: {_unknown_kind(kind)}; valid kinds: {', '.join(KINDS)} "
                             f"(or 'dense')")
        if not sep or not num:
            raise ValueError(f"sparsity spec {spec!r}: {kind!r} needs a keep ratio, e.g. '{kind}:0.5'")
        try:
            keep = float(num)
        except ValueError:
            raise ValueError(f"sparsity spec {spec!r}: keep ratio {num!r} of {kind!r} is not a number") from None
        if not (0.0 < keep <= 1.0):
            raise ValueError(f"sparsity spec {spec!r}: {kind}:{num}: keep ratio must be in (0, 1]")
        if any(k == kind for k, _ in parts):
            raise ValueError(f"sparsity spec {spec!r}: structure kind {kind!r} given more than once")
        parts.append((kind, keep))
    return StructureSpec(tuple(parts))


class Targets(NamedTuple):
    """Which weights of a model the kinds beyond convs can hold: ``linear``, the 2-D weights of its
    ``nn.Linear`` layers; ``hidden``, its MLP pairs ``{consumer: producer}`` (a linear reading another linear's
    outputs alone); ``heads``, its attention modules' head groups (objects with ``members``, the weight names,
    and ``module``); ``conv``, the weights of its conv layers (None: every 4-D parameter, when the model is not
    known). :func:`prunex_hvd.engine.dependencies.structure_targets` finds them."""
    linear: frozenset = frozenset()
    hidden: Mapping = {}
    heads: tuple = ()
    conv: Optional[frozenset] = None

    def is_conv(self, name: str, p) -> bool:
        return p.dim() == 4 and (self.conv is None or name in self.conv)

    def head_members(self) -> Dict[str, object]:
        return {n: g for g in self.heads for n in g.members}


def _fitting(name: str, p, spec: StructureSpec, targets: Targets) -> StructureSpec:
    """The parts of ``spec`` that ``name`` can hold: conv kinds on a 4-D weight, linear kinds on a linear
    weight, head on an attention module's member."""
    kinds = CONV_KINDS if targets.is_conv(name, p) else ()
    if name in targets.linear:
        kinds += LINEAR_KINDS
    if name in targets.head_members():
        kinds += HEAD_KINDS
    return spec.only(kinds)


def resolve_specs(named_params, sparsity, targets: Optional[Targets] = None) -> dict:
    """Which parameters get which structure: ``{name: StructureSpec}`` for the constrained weights only.

    ``sparsity`` is ``None`` (nothing), one spec, or a dict ``{glob: spec}``. One spec: its conv parts hold every
    conv weight (every 4-D parameter without ``targets``); ``neuron:K`` the hidden layer of every MLP (the producer of each of ``targets.hidden``'s
    pairs: never a classifier or a projection into a residual stream), ``feature:K`` the reader of it; ``head:K``
    every attention module's heads (``targets.heads``). A dict: for each parameter the first glob
    (:func:`fnmatch.fnmatchcase`, case-sensitive) matching its name in dict order decides, and the parameter
    takes the parts of that spec its kind can hold, so ``{"conv1.*": "dense", "*": "channel:0.5"}`` spares
    ``conv1``. A glob that matches nothing, or whose spec fits none of the parameters it matches, is an error
    rather than a silent no-op: a typo there would otherwise train a dense model. So is a spec beyond convs
    without ``targets`` (the model's layers), and an attention module whose weights ask for different heads.
    """
    params = [(name, p) for name, p in named_params]
    if sparsity is None:
        return {}
    beyond = set(LINEAR_KINDS + HEAD_KINDS)
    if targets is None:
        asked = [sparsity] if not isinstance(sparsity, Mapping) else list(sparsity.values())
        if any(k in beyond for spec in asked for k, _ in _parts_or_none(spec)):
            raise ValueError("structures beyond convs (neuron, feature, head) need the model's layers: "
                             "pass targets=dependencies.structure_targets(model)")
        targets = Targets()
    if not isinstance(sparsity, Mapping):
        spec = parse_spec(sparsity)
        out = {}
        conv = spec.only(CONV_KINDS)
        if not conv.is_dense:
            out.update({name: conv for name, p in params if targets.is_conv(name, p)})
        for kind, where in (("neuron", set(targets.hidden.values())), ("feature", set(targets.hidden))):
            if spec.keep(kind) is not None:
                if not where:
                    raise ValueError(f"sparsity {str(spec)!r}: '{kind}:K' prunes the hidden layers of MLPs (a "
                                     f"linear reading another linear's outputs through element-wise ops only), "
                                     f"and this model has none (or torch.fx cannot trace it); name the layers with a dict "
                                     f"instead")
                for name in where:
                    out[name] = StructureSpec(out.get(name, DENSE).parts + ((kind, spec.keep(kind)),))
        if spec.keep("head") is not None:
            if not targets.heads:
                raise ValueError(f"sparsity {str(spec)!r}: 'head:K' needs attention modules (nn.MultiheadAttention, "
                                 f"or num_heads with q/k/v and proj linears), and this model has none")
            out.update({n: spec.only(HEAD_KINDS) for n in targets.head_members()})
        order = {name: i for i, (name, _) in enumerate(params)}
        return _checked_heads({n: out[n] for n in sorted(out, key=order.__getitem__)}, targets)

    rules = []
    for glob, s in sparsity.items():
        if not isinstance(glob, str):
            raise TypeError(f"sparsity dict keys must be parameter-name globs (str), not {glob!r}")
        try:
            spec = parse_spec(s)
        except (ValueError, TypeError) as e:
            raise type(e)(f"sparsity[{glob!r}]: {e}") from None
        matched = [(name, p) for name, p in params if fnmatch.fnmatchcase(name, glob)]
        if not matched:
            some = ", ".join(name for name, _ in params[:6]) + (", ..." if len(params) > 6 else "")
            raise ValueError(f"sparsity glob {glob!r} matches no parameter (names look like: {some or 'none'})")
        if not spec.is_dense and all(_fitting(n, p, spec, targets).is_dense for n, p in matched):
            name, p = matched[0]
            why = [text for kinds, text in
                   ((CONV_KINDS, "not a conv weight (4-D); filter/channel/shape apply to conv weights only"),
                    (LINEAR_KINDS, "not an nn.Linear weight; neuron/feature apply to linear weights only"),
                    (HEAD_KINDS, "not a projection of an attention module; head applies to those only"))
                   if not spec.only(kinds).is_dense]
            raise ValueError(f"sparsity[{glob!r}] = {str(spec)!r}: {name!r} (shape {tuple(p.shape)}) is "
                             + " and ".join(why))
        rules.append((glob, spec))

    out = {}
    for name, p in params:
        for glob, spec in rules:
            if fnmatch.fnmatchcase(name, glob):
                fit = _fitting(name, p, spec, targets)
                if not fit.is_dense:
                    out[name] = fit
                break
    return _checked_heads(out, targets)


def _parts_or_none(spec) -> tuple:
    """The parts of ``spec``, or none when it does not parse (the caller's own parse says why, in context)."""
    try:
        return parse_spec(spec).parts
    except (TypeError, ValueError):
        return ()


def _checked_heads(specs: dict, targets: Targets) -> dict:
    """``specs``, after checking every attention module's weights ask for one thing: all the same ``head:K``
    and nothing else, or no head stage at all."""
    for group in targets.heads:
        asked = {n: specs.get(n, DENSE) for n in group.members}
        with_head = [n for n, s in asked.items() if s.keep("head") is not None]
        if with_head and (len({str(s) for s in asked.values()}) != 1):
            raise ValueError(f"attention {group.module or 'module'!r}: a head is pruned from all of "
                             f"{', '.join(group.members)} at once, so they need the same 'head:K' and no other "
                             f"stage; got " + ", ".join(f"{n}: {str(s)!r}" for n, s in asked.items()))
    return specs


def _suggest(overrides: dict, sparsity) -> dict:
    """The user's ``sparsity`` with ``overrides`` ({name: spec}) put first, as a dict to paste back."""
    rules = dict(sparsity) if isinstance(sparsity, Mapping) else {"*": str(parse_spec(sparsity))}
    return {**overrides, **{g: (s if isinstance(s, str) else str(parse_spec(s))) for g, s in rules.items()
                            if g not in overrides}}


def check_layer_types(model: torch.nn.Module, specs: Mapping[str, "StructureSpec"], sparsity=None) -> None:
    """``ValueError`` when a structured weight belongs to a layer whose weight the GEMM view does not fit.

    * ``ConvTranspose2d``: its weight is ``(C_in, C_out/groups, KH, KW)``, so 'filter' would drop its input
      channels and 'channel' its outputs. It must stay dense.
    * a grouped ``Conv2d`` (``groups > 1``): dim 1 holds ``C_in/groups`` channels of EACH group, so 'channel c'
      or a 'shape' column would be dropped at the same place in every group at once, not as the user means
      it. Dropping output filters is valid there: 'filter:K' is accepted. A depthwise conv (one input channel
      per filter) passes with 'channel:K' too: that stage can drop nothing there (:func:`stages_removing_nothing`
      reports it).

    ``sparsity`` (the user's argument, optional) only shapes the message: it shows the dict to write instead.
    """
    problems, overrides = [], {}
    for module_name, module in model.named_modules():
        name = f"{module_name}.weight" if module_name else "weight"
        spec = specs.get(name)
        if spec is None or getattr(module, "weight", None) is None:
            continue
        kind = type(module).__name__
        if isinstance(module, torch.nn.modules.conv._ConvTransposeNd):
            problems.append(f"{name!r} belongs to a {kind}, whose weight is (C_in, C_out/groups, KH, KW): "
                            f"'filter' would drop its input channels and 'channel' its outputs")
            overrides[name] = "dense"
        elif isinstance(module, torch.nn.Conv2d) and module.groups > 1:
            per_group = module.weight.shape[1]
            ksize = module.weight.shape[2] * module.weight.shape[3]
            bad = [k for k, _ in spec.parts if (k == "channel" and per_group > 1) or (k == "shape" and
                                                                                     per_group * ksize > 1)]
            if bad:
                problems.append(f"{name!r} belongs to a grouped {kind} (groups={module.groups}, {per_group} input "
                                f"channels per group): {' and '.join(repr(k) for k in bad)} would drop the same "
                                f"position in every group at once")
                keeps = dict(spec.parts)
                overrides[name] = f"filter:{_fmt_keep(keeps.get('filter', keeps[bad[0]]))}"
    if problems:
        advice = "leave it dense" if len(problems) == 1 else "leave them dense"
        if any(s.startswith("filter") for s in overrides.values()):
            advice += " (a grouped conv may lose whole output filters)"
        instead = _suggest(overrides, sparsity if sparsity is not None else "dense")
        raise ValueError("structured sparsity does not fit these layers: " + "; ".join(problems) +
                         f". Instead, {advice}, e.g. sparsity={instead!r}")


def stages_removing_nothing(shapes: Mapping[str, Tuple[int, ...]],
                            specs: Mapping[str, "StructureSpec"]) -> dict:
    """``{name: (kind, ...)}``: the stages of each layer's spec that can remove nothing from its weight, whatever
    its values: a keep ratio below 1 whose kept count is still every group (``channel:K`` on a stem that reads
    one input channel, or on a depthwise conv; ``filter:K`` on a one-filter layer; ``shape:K`` keeping at least
    the columns the channel stage left). A stage written with keep 1 asks for nothing and is not listed.
    ``shapes``: ``{name: weight shape}`` (tensors work too)."""
    out = {}
    for name, spec in specs.items():
        spec = parse_spec(spec)
        shape = tuple(getattr(shapes[name], "shape", shapes[name]))
        if len(shape) != 4:
            continue
        c_out, c_in = shape[0], shape[1]
        ksize = shape[2] * shape[3]
        columns_left = c_in * ksize
        idle = []
        for kind, keep in spec.parts:
            if kind == "filter":
                removes = keep_count(keep, c_out) < c_out
            elif kind == "channel":
                kept = keep_count(keep, c_in)
                removes, columns_left = kept < c_in, kept * ksize
            else:   # shape ranks all C_in*KH*KW columns, the channel stage's zeros among them
                removes = keep_count(keep, c_in * ksize) < columns_left
            if not removes and keep < 1.0:
                idle.append(kind)
        if idle:
            out[name] = tuple(idle)
    return out


def keep_count(keep: float, n: int) -> int:
    """How many of ``n`` groups a keep ratio keeps: ``ceil(keep*n)`` clamped to ``[1, n]``.

    ``keep*n`` in floating point can land a hair above an integer (``0.1+0.2`` is not ``0.3``); the small
    tolerance stops that from keeping one extra group.
    """
    n = int(n)
    if n < 1:
        raise ValueError(f"keep_count: need at least one group, got n={n}")
    if not (0.0 < keep <= 1.0):
        raise ValueError(f"keep ratio must be in (0, 1], got {keep!r}")
    k = math.ceil(keep * n - max(1e-9, n * 1e-12))
    return min(max(k, 1), n)
