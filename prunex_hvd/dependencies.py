"""Which conv produces the channels another conv reads: the pairs that channel pruning can prune together.

In ``conv1 → bn1 → relu → conv2`` the input channel ``c`` of ``conv2`` is filter ``c`` of ``conv1``, and nothing
else reads it. Once ``conv2`` drops input channel ``c``, filter ``c`` of ``conv1`` (and its BatchNorm channel)
computes a value no one uses: it can go too, and with it the traffic it would cost. Torch-Pruning's DepGraph
calls this a dependency group; here only the simple, common case is found, by walking a ``torch.fx`` trace:

* the consumer and the producer are ``nn.Conv2d`` with ``groups=1``;
* between them lie only channel-wise modules or functions (BatchNorm, activations, dropout, identity);
* every value on the way, the producer's output included, has exactly one user. A residual stream (read by
  an add as well) is never coupled, so a ResNet's shortcut and block outputs keep their channels.
"""
from __future__ import annotations

import operator
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

_CHANNELWISE_MODULES = (nn.BatchNorm2d, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU, nn.GELU, nn.Hardswish,
                        nn.Sigmoid, nn.Tanh, nn.ELU, nn.Mish, nn.Identity, nn.Dropout, nn.Dropout2d)
_CHANNELWISE_FUNCTIONS = {F.relu, F.relu6, F.leaky_relu, F.silu, F.gelu, F.hardswish, F.elu, F.mish,
                          torch.relu, torch.relu_, torch.sigmoid, torch.tanh, F.dropout, operator.pos}
_CHANNELWISE_METHODS = {"relu", "relu_", "sigmoid", "tanh"}


def channel_couplings(model: nn.Module) -> Dict[str, str]:
    """``{consumer conv weight name: producer conv weight name}`` for every conv whose input channels come
    from one other conv and go nowhere else. Raises ``ValueError`` when ``torch.fx`` cannot trace the model
    (data-dependent control flow): coupling is then not available for it."""
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception as e:   # fx raises many types (TraceError, TypeError, NotImplementedError...)
        raise ValueError(f"coupled channel pruning needs a model that torch.fx can trace; tracing "
                         f"{type(model).__name__} failed: {type(e).__name__}: {e}") from None
    modules = dict(model.named_modules())

    def conv(node):
        m = modules.get(node.target) if node.op == "call_module" else None
        return m if isinstance(m, nn.Conv2d) and m.groups == 1 else None

    def channelwise(node) -> bool:
        if node.op == "call_module":
            return isinstance(modules.get(node.target), _CHANNELWISE_MODULES)
        if node.op == "call_function":
            return node.target in _CHANNELWISE_FUNCTIONS
        return node.op == "call_method" and node.target in _CHANNELWISE_METHODS

    pairs: Dict[str, str] = {}
    for node in graph.nodes:
        consumer = conv(node)
        if consumer is None or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        x = node.args[0]
        while len(x.users) == 1 and channelwise(x) and x.args and isinstance(x.args[0], torch.fx.Node):
            x = x.args[0]
        producer = conv(x)
        if producer is not None and len(x.users) == 1 and producer.out_channels == consumer.in_channels:
            pairs[f"{node.target}.weight"] = f"{x.target}.weight"
    return pairs
