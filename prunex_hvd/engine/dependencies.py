"""Which layer produces the channels another layer reads: the pairs that channel pruning can prune together,
the residual streams, and the heads of attention modules.

In ``conv1 → bn1 → relu → conv2`` the input channel ``c`` of ``conv2`` is filter ``c`` of ``conv1``, and nothing
else reads it. Once ``conv2`` drops input channel ``c``, filter ``c`` of ``conv1`` (and its BatchNorm channel)
computes a value no one uses: it can go too, and with it the traffic it would cost. Torch-Pruning's DepGraph
calls this a dependency group; here only the simple, common case is found, by walking a ``torch.fx`` trace:

* the consumer and the producer are ``nn.Conv2d`` with ``groups=1``, or both ``nn.Linear`` (an MLP: fc1's
  hidden neurons are fc2's input features);
* between them lie only channel-wise modules or functions (BatchNorm, activations, dropout, identity);
* every value on the way, the producer's output included, has exactly one user. A residual stream (read by
  an add as well) is never a pair;
* each of the two convs' weights is used once in the model: a conv called twice, or two convs sharing one
  weight, would put that weight in two places' groups.

:func:`channel_streams` finds the residual streams (``coupled="streams"``): the values joined by adds, and
everything channel-wise on them, carry one channel space. Every conv writing into it (the stem, each block's
last conv, a projection shortcut) and every conv reading it (block first convs, shortcut convs) must agree on
channel ``c`` for export to remove it, so they form one group per stream.

:func:`attention_heads` finds the heads (``head:K``): head ``h`` of an attention module is rows
``h·d … (h+1)·d − 1`` of each of its query, key and value projections and the same columns of its output
projection; dropping all of them together removes the head.
"""
from __future__ import annotations

import operator
import threading
from typing import Dict, List, NamedTuple, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import compact_compute

_CHANNELWISE_MODULES = (nn.BatchNorm2d, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU, nn.GELU, nn.Hardswish,
                        nn.Sigmoid, nn.Tanh, nn.ELU, nn.Mish, nn.Identity, nn.Dropout, nn.Dropout2d)
_CHANNELWISE_FUNCTIONS = {F.relu, F.relu6, F.leaky_relu, F.silu, F.gelu, F.hardswish, F.elu, F.mish,
                          torch.relu, torch.relu_, torch.sigmoid, torch.tanh, F.dropout, operator.pos}
_CHANNELWISE_METHODS = {"relu", "relu_", "sigmoid", "tanh"}
# on a stream, pooling maps channel c to channel c too (a stem's max-pool sits between it and layer1)
_POOLING_MODULES = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
_POOLING_FUNCTIONS = {F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d}
_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
_ADD_METHODS = {"add", "add_"}


class HeadGroup(NamedTuple):
    """One attention module's heads. ``rows``: weights whose rows are the heads' query/key/value outputs, each
    ``blocks × num_heads × head_dim`` rows (a packed ``in_proj_weight`` or ``qkv`` holds 3 blocks, q, k, v);
    ``cols``: the output projection, whose input columns are ``num_heads × head_dim``, head by head."""
    module: str
    num_heads: int
    rows: Tuple[Tuple[str, int], ...]   # (weight name, blocks)
    cols: Tuple[str, ...]

    @property
    def members(self) -> Tuple[str, ...]:
        return tuple(n for n, _ in self.rows) + self.cols


class Stream(NamedTuple):
    """One residual stream's channel group: conv weight names that read it (input channel ``c``) and that
    write into it (filter ``c``), each sorted."""
    readers: Tuple[str, ...]
    writers: Tuple[str, ...]


class _ThisThreadTracer(torch.fx.Tracer):
    """``torch.fx.Tracer`` that traces only its own thread. While fx traces it patches ``nn.Module.__call__``
    and ``__getattr__`` for the whole process: a module called meanwhile in another thread (another rank of a
    threaded cluster, already training) would be traced into this graph or fail. Those calls run as usual.
    Two traces at once would also undo each other's patches out of order and leave one installed for good,
    so :func:`symbolic_trace` runs one at a time."""

    def __init__(self):
        super().__init__()
        self._thread = threading.get_ident()

    def call_module(self, m, forward, args, kwargs):
        if threading.get_ident() != self._thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def is_leaf_module(self, m, module_qualified_name) -> bool:
        # a layer computing on its kept block (compact_compute) is still the conv or linear it was
        return compact_compute.is_compact(m) or super().is_leaf_module(m, module_qualified_name)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if threading.get_ident() != self._thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)


_ONE_TRACE_AT_A_TIME = threading.Lock()


def _traced_graph(model: nn.Module) -> torch.fx.Graph:
    """``model``'s fx graph, traced safely while other threads run models (see :class:`_ThisThreadTracer`)."""
    with _ONE_TRACE_AT_A_TIME:
        graph = _ThisThreadTracer().trace(model)
    graph._tracer_cls = None   # a GraphModule pickled from it must load without this module
    return graph


def symbolic_trace(model: nn.Module) -> torch.fx.GraphModule:
    """``torch.fx.symbolic_trace(model)``, safe while other threads run models (see :class:`_ThisThreadTracer`).
    The module it returns pickles and loads with torch alone."""
    return torch.fx.GraphModule(model, _traced_graph(model), type(model).__name__)


def _trace(model: nn.Module):
    try:
        graph = _traced_graph(model)   # the walk needs the graph alone, not a GraphModule's generated code
    except Exception as e:   # fx raises many types (TraceError, TypeError, NotImplementedError...)
        raise ValueError(f"coupled channel pruning needs a model that torch.fx can trace; tracing "
                         f"{type(model).__name__} failed: {type(e).__name__}: {e}") from None
    modules = dict(model.named_modules())

    def conv(node, linear=False):
        m = modules.get(node.target) if node.op == "call_module" else None
        return m if (isinstance(m, nn.Conv2d) and m.groups == 1) or (linear and isinstance(m, nn.Linear)) else None

    def channelwise(node, pooling=False) -> bool:
        if node.op == "call_module":
            kinds = _CHANNELWISE_MODULES + (_POOLING_MODULES if pooling else ())
            return isinstance(modules.get(node.target), kinds)
        if node.op == "call_function":
            return node.target in _CHANNELWISE_FUNCTIONS or (pooling and node.target in _POOLING_FUNCTIONS)
        return node.op == "call_method" and node.target in _CHANNELWISE_METHODS

    return graph, conv, channelwise


def _used_once(graph, model: nn.Module):
    """``used_once(node)``: the weight of the module ``node`` calls is used by this call alone. A module called
    twice, or one whose weight another module shares (tied weights), puts one weight in two places."""
    modules = dict(model.named_modules())
    uses: Dict[int, int] = {}

    def key(node):
        m = modules.get(node.target)
        w = getattr(m, "weight", None)
        return id(w) if isinstance(w, torch.Tensor) else id(m)

    for node in graph.nodes:
        if node.op == "call_module":
            uses[key(node)] = uses.get(key(node), 0) + 1
    return lambda node: uses.get(key(node)) == 1


def _width(layer: nn.Module, side: str) -> int:
    if isinstance(layer, nn.Linear):
        return layer.out_features if side == "out" else layer.in_features
    return layer.out_channels if side == "out" else layer.in_channels


def channel_couplings(model: nn.Module) -> Dict[str, str]:
    """``{consumer weight name: producer weight name}`` for every conv whose input channels come from one other
    conv and go nowhere else, and every linear whose input features are one other linear's outputs alone (an
    MLP's hidden layer). A layer whose weight is used more than once (called twice, or tied to another's) is in
    no pair, nor in a stream: each use may have other readers. Raises ``ValueError`` when ``torch.fx`` cannot
    trace the model (data-dependent control flow): coupling is then not available."""
    graph, conv, channelwise = _trace(model)
    used_once = _used_once(graph, model)
    pairs: Dict[str, str] = {}
    plain_type = compact_compute.plain_type   # (a layer computing on its kept block is still a conv)
    for node in graph.nodes:
        consumer = conv(node, linear=True)
        if consumer is None or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        x = node.args[0]
        while len(x.users) == 1 and channelwise(x) and x.args and isinstance(x.args[0], torch.fx.Node):
            x = x.args[0]
        producer = conv(x, linear=True)
        # A conv called twice (or sharing its weight) has one weight for two places in the graph: its filters or
        # input channels would belong to two groups at once, and a pair would be decided for one call only.
        same_kind = producer is not None and plain_type(producer) is plain_type(consumer)
        if same_kind and len(x.users) == 1 and _width(producer, "out") == _width(consumer, "in") \
                and used_once(node) and used_once(x):
            pairs[f"{node.target}.weight"] = f"{x.target}.weight"
    return pairs


# an attention module of one's own (timm's, a ViT's): ``num_heads`` and Linear children under these names
_PACKED_QKV = ("qkv", "in_proj")
_SEPARATE_QKV = (("q", "k", "v"), ("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))
_OUT_PROJ = ("proj", "out_proj", "o_proj", "out")


def attention_heads(model: nn.Module) -> List[HeadGroup]:
    """Every attention module's :class:`HeadGroup`: ``nn.MultiheadAttention`` (a packed ``in_proj_weight``, or
    separate ``q/k/v_proj_weight``), and any module with an integer ``num_heads`` whose ``nn.Linear`` children are
    a packed ``qkv`` (or ``in_proj``) or separate ``q, k, v`` (``q_proj, k_proj, v_proj``; ``query, key, value``),
    and an output projection ``proj`` (``out_proj``, ``o_proj``, ``out``). A module whose sizes do not divide
    into its heads is skipped."""
    groups, params = [], dict(model.named_parameters())
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        heads = getattr(m, "num_heads", None)
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            continue
        if isinstance(m, nn.MultiheadAttention):
            rows = ((f"{prefix}in_proj_weight", 3),) if m.in_proj_weight is not None else \
                tuple((f"{prefix}{k}_proj_weight", 1) for k in "qkv")
            cols = (f"{prefix}out_proj.weight",)
        else:
            kids = {k: c for k, c in m.named_children() if isinstance(c, nn.Linear)}
            packed = next((k for k in _PACKED_QKV if k in kids), None)
            separate = next((t for t in _SEPARATE_QKV if all(k in kids for k in t)), None)
            out = next((k for k in _OUT_PROJ if k in kids), None)
            if out is None or (packed is None) == (separate is None):
                continue
            rows = ((f"{prefix}{packed}.weight", 3),) if packed else tuple((f"{prefix}{k}.weight", 1) for k in separate)
            cols = (f"{prefix}{out}.weight",)
        if not all(n in params and params[n].dim() == 2 for n in (*(n for n, _ in rows), *cols)):
            continue
        sizes = [params[n].shape[0] / b for n, b in rows] + [params[n].shape[1] for n in cols]
        if len(set(sizes)) == 1 and sizes[0] % heads == 0:
            groups.append(HeadGroup(name, heads, rows, cols))
    return groups


def channel_streams(model: nn.Module) -> List[Stream]:
    """The residual streams whose readers and writers are all plain convs: one :class:`Stream` each. A feature
    map without an add but read by several convs (a bottleneck stage's input, read by its first conv and its
    projection shortcut) counts too.

    Union-find over the ``torch.fx`` trace: an add joins its output and every tensor it adds; a channel-wise
    op (BatchNorm, activations, pooling) joins its output and input. A class holding an add is a stream. Its
    writers are the nodes whose output enters it from outside, its readers the nodes outside that use a value
    of it. A stream is skipped (its convs keep per-layer masks) when any writer or reader is not a
    ``groups=1`` ``nn.Conv2d`` taking it as input (the model input, a linear head behind pooling, a grouped
    conv, a concat...), when the channel counts do not match, or when a conv's weight is used more than once
    in the model (a conv called twice, tied weights). Raises ``ValueError`` when ``torch.fx`` cannot trace the
    model."""
    graph, conv, channelwise = _trace(model)
    parent: Dict = {}

    def find(n):
        while parent.setdefault(n, n) is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def is_add(node) -> bool:
        return (node.op == "call_function" and node.target in _ADD_FUNCTIONS) or \
            (node.op == "call_method" and node.target in _ADD_METHODS)

    used_once = _used_once(graph, model)
    for node in graph.nodes:
        joined = [a for a in node.args if isinstance(a, torch.fx.Node)] if is_add(node) else \
            node.args[:1] if channelwise(node, pooling=True) and node.args and \
            isinstance(node.args[0], torch.fx.Node) else []
        for a in joined:
            parent[find(a)] = find(node)
    classes: Dict = {}
    for node in graph.nodes:
        if node in parent:
            classes.setdefault(find(node), []).append(node)

    streams = []
    for members in classes.values():
        inside = set(members)
        writers = [n for n in members if not is_add(n) and not (channelwise(n, pooling=True) and n.args
                                                                and n.args[0] in inside)]
        readers = {u for n in members for u in n.users if u not in inside}
        if not any(is_add(n) for n in members) and len(readers) < 2:
            continue   # a plain chain: one of channel_couplings' pairs, or nothing to share
        if not all(conv(n) is not None and used_once(n) for n in writers) or \
                not all(conv(u) is not None and used_once(u) and u.args[0] in inside for u in readers):
            continue
        sizes = {conv(n).out_channels for n in writers} | {conv(u).in_channels for u in readers}
        if readers and len(sizes) == 1:
            streams.append(Stream(tuple(sorted(f"{u.target}.weight" for u in readers)),
                                  tuple(sorted(f"{n.target}.weight" for n in writers))))
    return sorted(streams)


def structure_targets(model: nn.Module) -> "Targets":
    """What the kinds beyond convs can hold in ``model`` (:class:`~prunex_hvd.engine.sparsity.spec.Targets`):
    its linear weights, its MLP pairs (from the ``torch.fx`` walk; none when the model does not trace) and
    its attention modules' head groups."""
    from .sparsity.spec import Targets

    linear = frozenset(f"{n}.weight" if n else "weight" for n, m in model.named_modules() if isinstance(m, nn.Linear))
    try:
        pairs = channel_couplings(model)
    except ValueError:
        pairs = {}
    hidden = {c: p for c, p in pairs.items() if c in linear and p in linear}
    conv = frozenset(f"{n}.weight" if n else "weight" for n, m in model.named_modules()
                     if isinstance(m, nn.modules.conv._ConvNd))
    return Targets(linear, hidden, tuple(attention_heads(model)), conv)
