"""Export the finalized, structurally sparse model as a physically smaller dense model.

After ``finalize()`` the model is exactly structurally sparse but still full size: pruned filters and input
channels are zeros that dense kernels multiply anyway. :func:`slim` removes them for real.

    from prunex_hvd.app import export
    small, report = export.slim(model, example_input)          # same outputs, fewer channels
    export.save(small, "model_slim.pt", example_input)          # plain torch: torch.load(p, weights_only=False)
    export.export_run("runs/NAME", out="runs/NAME/model_slim.pt")   # what `prunex-hvd export` runs

Which channels go. Torch-Pruning's dependency graph (``torch_pruning.DependencyGraph``) finds, for every
feature map, the group of layers that must agree on its channels: the convs/linears that write it (with their
BatchNorm), the ones that read it, and every add of a residual stream along the way. The decision per channel
``c`` of a group is ours and exact:

* **unread**: every reading conv/linear has its input channel ``c`` all zero. Nothing depends on the value, so
  ``c`` goes from writers, BatchNorms and readers alike (whatever the writers' filters hold).
* **dead**: every writing conv/linear has filter ``c`` at zero, but some reader still reads it. The channel is
  then input-independent: its bias, or BatchNorm's ``beta - gamma*mean/std``, through GELU/ReLU, adds and
  pooling, is a constant. Its value ``k`` is read at each reader's input on real data (and checked on a
  second, random batch). ``k == 0`` everywhere: ``c`` goes. Otherwise ``c`` goes only if every reader can
  absorb it exactly: a Linear, or a conv without padding (a 1x1), whose bias gains ``k * W[:, c].sum()``
  (a bias is added where the conv had none). A padded conv sees zeros at the border instead of ``k``, so
  folding would change the border outputs: such a channel is kept (reported as ``kept_constant``).
* anything else is live and stays, and so does the last channel of a group (layers need one).

Residual streams are one group, so a stream channel goes only where every block reading the stream agrees;
with per-layer channel masks they rarely do, and the zero columns stay in the slim model (``params_nonzero``
says how many). A group holding a layer Torch-Pruning would prune with other semantics (grouped convs, norms
other than BatchNorm, LayerNorm, attention...) or reaching the model output is left whole: a transformer's
residual stream stays, its MLPs' hidden units go (fc1 → GELU → fc2 is such a group).

Attention heads (``head:K``) go before the graph is built: a head whose columns of the output projection are
all zero adds nothing, so its q/k/v rows and those columns are cut and ``num_heads`` lowered
(:func:`_drop_heads`; modules with separate ``q/k/v`` or a packed ``qkv`` linear, not ``nn.MultiheadAttention``,
whose width is tied to its heads). Finally the slim model is run against the original on the calibration batch
and must match, else :func:`slim` raises.
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..engine.compact_compute import compute_in_full
from ..engine.dependencies import attention_heads, symbolic_trace

__all__ = ["check_structured", "compare", "count_flops", "count_params", "export_run", "load", "measure_latency",
           "save", "slim"]

SUFFIXES = (".pt", ".pt2")


# ------------------------------------------------------------------------------------------ inspection

def _plain_convs(model: nn.Module):
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d) and m.groups == 1 and not m.transposed:
            yield name, m


def structured_zeros(model: nn.Module) -> Dict[str, int]:
    """Whole-zero output filters and input channels over the plain convs of ``model``, and whole-zero rows
    (neurons) and input columns (features) over its linear layers."""
    filters = channels = neurons = features = 0
    for _, m in _plain_convs(model):
        w = m.weight.detach()
        filters += int((~(w != 0).flatten(1).any(1)).sum())
        channels += int((~(w != 0).any(dim=(0, 2, 3))).sum())
    for m in model.modules():
        if isinstance(m, nn.Linear):
            live = m.weight.detach() != 0
            neurons += int((~live.any(1)).sum())
            features += int((~live.any(0)).sum())
    return {"zero_filters": filters, "zero_input_channels": channels, "zero_neurons": neurons,
            "zero_features": features}


def check_structured(model: nn.Module, what: str = "the model") -> Dict[str, int]:
    """Raise ``ValueError`` unless some conv of ``model`` has a whole zero filter or input channel, or some
    linear a whole zero row or column."""
    zeros = structured_zeros(model)
    if not any(zeros.values()):
        raise ValueError(
            f"{what} was not trained with structured sparsity: no conv has a whole zero filter or input channel "
            f"and no linear a whole zero neuron or feature, so there is nothing to remove. Export the finalized "
            f"model of a PruneX run (--method prunex or prunex-flat with --sparsity filter:K / channel:K / "
            f"neuron:K / head:K), i.e. after opt.finalize()")
    return zeros


def _drop_heads(model: nn.Module, tp) -> List[Dict[str, Any]]:
    """Remove, in place, every attention head whose columns of the output projection are all zero: whatever
    its query, key and value compute, it adds nothing to the output. Its q/k/v rows (and biases) and those
    columns go (Torch-Pruning's ``prune_linear_out_channels`` / ``prune_linear_in_channels``) and the module's
    ``num_heads`` drops; one head always stays. ``nn.MultiheadAttention`` ties its heads to its embedding width,
    so it cannot lose one: reported as skipped."""
    modules = dict(model.named_modules())
    out = []
    for group in attention_heads(model):
        heads = group.num_heads
        proj = modules[group.cols[0].rpartition(".")[0]]
        d = proj.weight.shape[1] // heads
        dead = [h for h in range(heads) if not bool(proj.weight.detach()[:, h * d:(h + 1) * d].any())]
        dead = dead[:-1] if len(dead) == heads else dead
        info: Dict[str, Any] = {"module": group.module, "heads": heads, "removed": len(dead), "skipped": None}
        out.append(info)
        if not dead:
            continue
        attn = modules[group.module]
        if isinstance(attn, nn.MultiheadAttention):
            info.update(removed=0, skipped="nn.MultiheadAttention ties num_heads × head_dim to its embedding "
                                           "width: its zero heads stay")
            continue
        for name, blocks in group.rows:
            rows = [(b * heads + h) * d + j for b in range(blocks) for h in dead for j in range(d)]
            tp.prune_linear_out_channels(modules[name.rpartition(".")[0]], rows)
        tp.prune_linear_in_channels(proj, [h * d + j for h in dead for j in range(d)])
        attn.num_heads = heads - len(dead)
    return out


def count_params(model: nn.Module) -> Dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    nonzero = sum(int(torch.count_nonzero(p.detach())) for p in model.parameters())
    return {"params": total, "params_nonzero": nonzero}


def count_flops(model: nn.Module, example_input: torch.Tensor) -> int:
    """FLOPs of one forward pass on ``example_input`` (``torch.utils.flop_counter``: convs and matmuls,
    2 per multiply-add). A masked model runs its zeros through dense kernels, so they count."""
    from torch.utils.flop_counter import FlopCounterMode

    mode = FlopCounterMode(display=False)
    with torch.inference_mode(), mode:
        model(example_input)
    return int(mode.get_total_flops())


# ----------------------------------------------------------------------------------------- the surgery

def _members(group, DG, tp, attention=frozenset()):
    """Sort a Torch-Pruning group into writers, readers and others; ``None`` with a reason when unsupported
    (``attention``: the q/k/v and output projections of attention modules, whose channels go a head at a time)."""
    writers, readers, bns = [], [], []
    for item in group:
        dep, node = item.dep, item.dep.target
        mod = node.module
        rmap: Dict[int, List[int]] = {}
        for i, r in zip(item.idxs, item.root_idxs):
            rmap.setdefault(int(r), []).append(int(i))
        if node.type == tp.ops.OPTYPE.OUTPUT:
            return None, "reaches the model output"
        if mod in attention:
            return None, f"{DG._module2name.get(mod)} is an attention projection: heads go whole, above"
        if isinstance(mod, (nn.Conv2d, nn.Linear)):
            if isinstance(mod, nn.Conv2d) and (mod.groups != 1 or mod.transposed):
                return None, f"{DG._module2name.get(mod)} is a grouped or transposed conv"
            (writers if DG.is_out_channel_pruning_fn(dep.handler) else readers).append((mod, rmap))
        elif isinstance(mod, nn.BatchNorm2d):
            bns.append(mod)
        elif node.type not in (tp.ops.OPTYPE.ELEMENTWISE, tp.ops.OPTYPE.RESHAPE):
            # norms over several channels, attention, concat/split...: removing a channel could change others
            return None, f"holds {type(mod).__name__} ({node.type.name}), which export does not slim"
    if not readers:
        return None, "no conv or linear reads it"
    return (writers, readers, bns), None


def _live_in(mod: nn.Module) -> torch.Tensor:
    w = mod.weight.detach()
    return (w != 0).any(dim=(0, 2, 3)) if w.dim() == 4 else (w != 0).any(dim=0)


def _live_out(mod: nn.Module) -> torch.Tensor:
    # a zero row with a bias writes a constant: dead, and the constant is read on real data before it folds
    return (mod.weight.detach() != 0).flatten(1).any(1)


def _foldable(mod: nn.Module) -> bool:
    if isinstance(mod, nn.Linear):
        return True
    pad = mod.padding
    return pad == "valid" or (not isinstance(pad, str) and all(p == 0 for p in pad))


def _capture(model: nn.Module, wanted: Dict[nn.Module, List[int]], batches: Sequence[torch.Tensor]):
    """The input channels ``wanted[module]`` of each module, over ``batches``: ``{module: [tensor per batch]}``."""
    seen: Dict[nn.Module, List[torch.Tensor]] = {m: [] for m in wanted}
    def keep(mod, inp):   # a conv's channels are dim 1; a linear's the last (tokens: (B, N, C))
        x = inp[0].reshape(-1, inp[0].shape[-1]) if isinstance(mod, nn.Linear) else inp[0]
        seen[mod].append(x[:, wanted[mod]].detach().clone())
    hooks = [m.register_forward_pre_hook(keep) for m in wanted]
    try:
        with torch.inference_mode():
            for x in batches:
                model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _constant(values: List[torch.Tensor], j: int) -> Optional[float]:
    """The value of channel ``j`` if it is the same at every sample and position of every batch, else None."""
    flat = torch.cat([v[:, j].reshape(-1) for v in values]).double()
    if not bool(torch.isfinite(flat).all()):
        return None
    k = float(flat[0])
    return k if float((flat - k).abs().max()) <= 1e-6 * max(1.0, abs(k)) else None


def slim(model: nn.Module, example_input: torch.Tensor, calibration: Optional[torch.Tensor] = None,
         seed: int = 0) -> Tuple[nn.Module, Dict[str, Any]]:
    """A smaller dense copy of ``model`` (eval mode, CPU) that computes the same function, and a report.

    ``example_input`` is a batch of the model's input (a couple of samples suffice); ``calibration`` a batch of
    real inputs used to read the value of dead-but-read channels (default: ``example_input``). ``model`` is
    not modified. Raises ``ValueError`` for a model without structured sparsity.
    """
    try:
        import torch_pruning as tp
    except ImportError as exc:   # an install_requires; a broken environment should still say what is missing
        raise RuntimeError("export needs the torch-pruning package (pip install torch-pruning)") from exc
    check_structured(model)
    device = next(model.parameters()).device
    work = copy.deepcopy(model).cpu().eval()
    for m in work.modules():   # layers still computing on their kept block (compact_compute): the same function
        compute_in_full(m)
    example_input = example_input.detach().cpu()
    calibration = example_input if calibration is None else calibration.detach().cpu()
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(calibration.shape, generator=gen, dtype=calibration.dtype) * 3   # a second, unlike batch

    heads = _drop_heads(work, tp)   # first: Torch-Pruning's graph does not see heads, only their channels
    modules = dict(work.named_modules())
    attention = {modules[n.rpartition(".")[0]] for g in attention_heads(work) for n in g.members
                 if n.rpartition(".")[2] == "weight"}   # the Linear projections (a packed in_proj is no module)
    with torch.enable_grad():   # Torch-Pruning traces through autograd
        DG = tp.DependencyGraph().build_dependency(work, example_inputs=example_input, verbose=False)
    names = DG._module2name
    groups = list(DG.get_all_groups(root_module_types=(nn.Conv2d, nn.Linear)))

    plans, wanted = [], {}
    for group in groups:
        root = group[0].dep.target.module
        n = len(group[0].idxs)
        info: Dict[str, Any] = {"root": names.get(root), "channels": n, "removed": 0, "unread": 0, "folded": 0,
                                "zero_constant": 0, "kept_constant": 0, "skipped": None}
        parts, why = _members(group, DG, tp, attention)
        plans.append((group, info, parts))
        if parts is None:
            info["skipped"] = why
            continue
        writers, readers, _ = parts
        live_in = [(m, rmap, _live_in(m).tolist()) for m, rmap in readers]
        live_out = [(m, rmap, _live_out(m).tolist()) for m, rmap in writers]
        unread, dead_read = [], []
        for r in range(n):
            read = any(live[i] for _, rmap, live in live_in for i in rmap.get(r, ()))
            written = any(live[i] for _, rmap, live in live_out for i in rmap.get(r, ()))
            if not read:
                unread.append(r)
            elif not written and writers:   # no writer at all: the channel comes from the model input
                dead_read.append(r)
        info["_unread"], info["_dead"], info["_live_in"] = unread, dead_read, live_in
        for m, rmap, live in live_in:
            idx = [i for r in dead_read for i in rmap.get(r, ()) if live[i]]
            if idx:
                wanted.setdefault(m, set()).update(idx)

    wanted = {m: sorted(s) for m, s in wanted.items()}
    seen = _capture(work, wanted, [calibration, noise]) if wanted else {}

    folds = []   # (module, input index, value), applied once every decision is made
    for group, info, parts in plans:
        if parts is None:
            continue
        live_in = info.pop("_live_in")
        remove = set(info.pop("_unread"))
        info["unread"] = len(remove)
        pending = {}
        for r in info.pop("_dead"):
            terms, ok = [], True
            for m, rmap, live in live_in:
                for i in rmap.get(r, ()):
                    if not live[i]:
                        continue
                    k = _constant(seen[m], wanted[m].index(i))
                    if k is None:   # an input-dependent path the graph does not show (e.g. the model input): live
                        ok, terms = False, terms + [(m, i, None)]
                    elif k != 0.0:
                        ok = ok and _foldable(m)
                        terms.append((m, i, k))
            if not terms:
                info["zero_constant"] += 1
                remove.add(r)
            elif ok:
                pending[r] = terms
                remove.add(r)
            elif all(k is not None for _, _, k in terms):
                info["kept_constant"] += 1
        if len(remove) == info["channels"]:   # a layer needs one channel: keep one, preferably an unfolded one
            keep = max(remove - set(pending)) if remove - set(pending) else max(remove)
            remove.discard(keep)
            pending.pop(keep, None)
        for terms in pending.values():
            folds.extend(terms)
        info["folded"] = len(pending)
        info["removed"] = len(remove)
        info["_remove"] = sorted(remove)

    with torch.no_grad():
        for m, i, k in folds:
            w = m.weight
            delta = k * (w[:, i].sum((1, 2)) if w.dim() == 4 else w[:, i])
            if m.bias is None:
                m.bias = nn.Parameter(torch.zeros(w.shape[0], dtype=w.dtype, device=w.device))
            m.bias.add_(delta.to(w.dtype))
    for group, info, parts in plans:
        remove = info.pop("_remove", [])
        if remove:
            group.prune(idxs=remove)

    was_training = model.training
    try:
        with torch.inference_mode():   # the guard: same function on the calibration batch, or no export
            want, got = model.eval()(calibration.to(device)).cpu(), work(calibration)
    finally:
        model.train(was_training)
    diff = float((want - got).abs().max())
    scale = max(1.0, float(want.abs().max()))
    if not diff <= 1e-4 * scale:
        raise RuntimeError(f"export: the slim model differs from the original by {diff:.3g} on the calibration batch "
                           f"(outputs up to {scale:.3g}); refusing to return it")
    groups_info = [dict(info) for _, info, _ in plans]
    report = {"groups": groups_info, "calibration_max_abs_diff": diff,
              **{k: sum(g[k] for g in groups_info) for k in
                 ("channels", "removed", "unread", "folded", "zero_constant", "kept_constant")},
              "skipped_groups": sum(g["skipped"] is not None for g in groups_info),
              "attention": heads, "heads": sum(h["heads"] for h in heads),
              "heads_removed": sum(h["removed"] for h in heads)}
    return work, report


# ------------------------------------------------------------------------------------------ save / load

def _plain_graph(model: nn.Module) -> nn.Module:
    """``model`` as a ``torch.fx.GraphModule``: its forward as generated code of torch.nn modules, so the
    pickle needs only torch to load."""
    gm = symbolic_trace(model)
    for node in gm.graph.nodes:
        node.type = None   # string annotations (``from __future__ import annotations``) break the pickle
    gm.recompile()
    return gm


def save(model: nn.Module, path: str, example_input: torch.Tensor) -> str:
    """Write ``model`` to ``path`` and return how to load it.

    ``.pt``: the whole module as a ``torch.fx.GraphModule`` pickle, an ordinary ``nn.Module`` (train, fine-tune,
    ``.to(device)``) loaded with ``torch.load(path, weights_only=False)``; needs torch, not prunex_hvd.
    ``.pt2``: a ``torch.export`` archive (batch size dynamic), loaded with ``torch.export.load(path).module()``;
    inference only. The weights are written as they are: use the file only from a source you trust.
    """
    suffix = os.path.splitext(path)[1]
    if suffix not in SUFFIXES:
        raise ValueError(f"the slim model's file must end in .pt (plain torch.nn module) or .pt2 (torch.export "
                         f"archive), got {path!r}")
    model = model.eval()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp" + suffix   # write then rename: a crash never leaves half a model under the name
    if suffix == ".pt":
        try:
            torch.save(_plain_graph(model), tmp)
        except Exception as exc:   # fx cannot trace data-dependent control flow
            raise ValueError(f"cannot write {path!r} as a plain torch module: torch.fx failed to trace "
                             f"{type(model).__name__} ({type(exc).__name__}: {exc}); use a .pt2 file") from None
        how = f"torch.load({path!r}, weights_only=False)"
    else:
        x = example_input.detach().cpu()
        batch = torch.export.Dim("batch", min=1, max=1 << 16)
        # a batch of 1 would let export specialise the batch size; 2 samples keep it symbolic
        x = x[:2] if len(x) >= 2 else torch.cat([x, x])
        ep = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
        torch.export.save(ep, tmp)
        how = f"torch.export.load({path!r}).module()"
    os.replace(tmp, path)
    return how


def load(path: str) -> nn.Module:
    """Load a slim model written by :func:`save` (trusted files only: a .pt pickle can run code)."""
    if not os.path.isfile(path):
        raise ValueError(f"no slim model at {path!r}")
    if path.endswith(".pt2"):
        return torch.export.load(path).module()
    return torch.load(path, map_location="cpu", weights_only=False)


# ---------------------------------------------------------------------------------------- measurements

def compare(reference: nn.Module, other: nn.Module, batches) -> Dict[str, Any]:
    """Both models on every ``(x, y)`` of ``batches`` in eval mode: worst output difference, agreement."""
    reference.eval()
    other.eval()
    n = same = 0
    diff = scale = 0.0
    with torch.inference_mode():
        for x, _ in batches:
            a, b = reference(x), other(x)
            diff = max(diff, float((a - b).abs().max()))
            scale = max(scale, float(a.abs().max()))
            same += int((a.argmax(1) == b.argmax(1)).sum())
            n += len(x)
    return {"samples": n, "max_abs_diff": diff, "max_abs_output": scale, "same_prediction": same / max(n, 1)}


def measure_latency(named: Dict[str, nn.Module], sample_shape: Sequence[int], batch_sizes=(1, 64),
                    repeats: int = 20, warmup: int = 3, seed: int = 0) -> Dict[str, Any]:
    """CPU forward latency of each model, interleaved in one process: for each batch size, ``repeats``
    rounds that run every model once (order alternating, so drift and contention hit all alike); median,
    min and max in milliseconds. The first model named is the reference of ``ratio`` (median / its median)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    names = list(named)
    for m in named.values():
        m.eval()
    gen = torch.Generator().manual_seed(seed)
    out: Dict[str, Any] = {"threads": torch.get_num_threads(), "repeats": repeats, "batch": {}}
    with torch.inference_mode():
        for bs in batch_sizes:
            x = torch.randn((int(bs), *sample_shape), generator=gen)
            times = {k: [] for k in names}
            for _ in range(warmup):
                for k in names:
                    named[k](x)
            for rep in range(repeats):
                for k in (names if rep % 2 == 0 else names[::-1]):
                    t0 = time.perf_counter()
                    named[k](x)
                    times[k].append(time.perf_counter() - t0)
            row = {k: {"median_ms": 1e3 * statistics.median(v), "min_ms": 1e3 * min(v), "max_ms": 1e3 * max(v)}
                   for k, v in times.items()}
            ref = row[names[0]]["median_ms"]
            for k in names:
                row[k]["ratio"] = row[k]["median_ms"] / ref
            out["batch"][str(int(bs))] = row
    return out


# ------------------------------------------------------------------------------------------ a run folder

def _read_json(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def load_run_model(run_dir: str) -> Tuple[nn.Module, dict]:
    """The finalized model of a ``prunex-hvd train`` run folder, rebuilt from ``final_model.pt`` (eval mode)."""
    from . import models

    if not os.path.isdir(run_dir):
        raise ValueError(f"{run_dir!r} is not a run folder (no such directory)")
    path = os.path.join(run_dir, "final_model.pt")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir!r} has no final_model.pt: export needs a finished `prunex-hvd train` run "
                         f"(it writes final_model.pt at the end; a --stop-after-rounds slice must be resumed to the end)")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"{path}: cannot load ({type(exc).__name__}: {exc})") from None
    need = ("model", "state_dict", "num_classes", "in_channels", "image_size")
    if not isinstance(blob, dict) or any(k not in blob for k in need):
        raise ValueError(f"{path} is not a prunex-hvd final model (needs the keys {', '.join(need)})")
    model = models.build(blob["model"], num_classes=blob["num_classes"], in_channels=blob["in_channels"])
    try:
        model.load_state_dict(blob["state_dict"])
    except RuntimeError as exc:
        raise ValueError(f"{path}: the state dict does not fit {blob['model']}: {exc}") from None
    return model.eval(), blob


def export_run(run_dir: str, out: Optional[str] = None, json_out: Optional[str] = None,
               data_dir: Optional[str] = None, samples: Optional[int] = None, batch_sizes=(1, 64),
               repeats: int = 20, measure: bool = True) -> Dict[str, Any]:
    """``prunex-hvd export``: slim the run's final model, check it on the run's test set, count, time, save.

    Returns (and writes to ``json_out``, default beside ``out``) the report: parameters, FLOPs, latency of the
    masked and the slim model, the equivalence check and what was removed. Raises ``ValueError`` for a folder
    without a finished run, a model without structured sparsity, or a slim model that does not match.
    """
    from .data import ShardedLoader, load_dataset

    out = out or os.path.join(run_dir, "model_slim.pt")
    if os.path.splitext(out)[1] not in SUFFIXES:   # before any work is paid for
        raise ValueError(f"--out must end in .pt (plain torch.nn module) or .pt2 (torch.export archive), got {out!r}")
    json_out = json_out or os.path.splitext(out)[0] + ".json"
    model, blob = load_run_model(run_dir)
    summary = _read_json(os.path.join(run_dir, "summary.json")) or {}
    config = (_read_json(os.path.join(run_dir, "config.json")) or {}).get("config", {})
    method = summary.get("method", config.get("method"))
    check_structured(model, f"the final model of {run_dir} (method {method or 'unknown'})")

    dataset = blob.get("dataset") or config.get("dataset")
    if not dataset:
        raise ValueError(f"{run_dir}: neither final_model.pt nor config.json names the dataset to check against")
    data = load_dataset(dataset, data_dir=data_dir or config.get("data_dir"), image_size=blob["image_size"],
                        seed=int(config.get("seed", 0)))
    loader = ShardedLoader(data, 256, 0, 1, train=False)
    test = []
    for x, y in loader.batches():
        test.append((x, y))
        if samples and sum(len(t[0]) for t in test) >= samples:
            break
    if samples:
        left = samples - sum(len(t[0]) for t in test[:-1])
        test[-1] = (test[-1][0][:left], test[-1][1][:left])
    calibration = test[0][0][:64]

    small, removed = slim(model, calibration[:2], calibration=calibration)
    same = compare(model, small, test)
    tol = 1e-4 * max(1.0, same["max_abs_output"])
    same["tolerance"] = tol
    if not same["max_abs_diff"] <= tol:
        raise ValueError(f"the slim model differs from the masked model by {same['max_abs_diff']:.3g} on the test "
                         f"set (tolerance {tol:.3g}); not saved")
    shape = tuple(calibration.shape[1:])
    one = calibration[:1]
    sizes = {"masked": {**count_params(model), "flops": count_flops(model, one)},
             "slim": {**count_params(small), "flops": count_flops(small, one)}}
    for key in ("params", "params_nonzero", "flops"):
        sizes.setdefault("ratio", {})[key] = sizes["slim"][key] / sizes["masked"][key]
    how = save(small, out, calibration)
    reloaded = load(out)
    with torch.inference_mode():
        reload_diff = float((reloaded(calibration) - small(calibration)).abs().max())
    if not reload_diff <= tol:
        raise RuntimeError(f"{out}: the model read back differs from the one written by {reload_diff:.3g}")

    report = {"run": os.path.abspath(run_dir), "model": blob["model"], "method": method,
              "sparsity": summary.get("sparsity", blob.get("sparsity")), "coupled": config.get("coupled"),
              "dataset": dataset, "input_shape": list(shape), "out": os.path.abspath(out), "load_with": how,
              "equivalence": same, "reload_max_abs_diff": reload_diff, **sizes,
              "flops_batch": 1, "removed": {k: v for k, v in removed.items() if k not in ("groups", "attention")},
              "attention": removed["attention"],
              "groups": removed["groups"]}
    if measure:
        report["latency"] = measure_latency({"masked": model, "slim": small}, shape, batch_sizes, repeats)
    os.makedirs(os.path.dirname(os.path.abspath(json_out)), exist_ok=True)
    with open(json_out, "w") as f:
        json.dump(report, f, indent=1)
    report["json"] = os.path.abspath(json_out)
    return report


def _si(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f}"


def format_report(report: Dict[str, Any]) -> str:
    """The table ``prunex-hvd export`` prints."""
    m, s = report["masked"], report["slim"]
    rows = [("params", _si(m["params"]), _si(s["params"]), f"{s['params'] / m['params']:.3f}"),
            ("params nonzero", _si(m["params_nonzero"]), _si(s["params_nonzero"]),
             f"{s['params_nonzero'] / m['params_nonzero']:.3f}"),
            ("FLOPs (batch 1)", _si(m["flops"]), _si(s["flops"]), f"{s['flops'] / m['flops']:.3f}")]
    lat = report.get("latency")
    if lat:
        for bs, row in lat["batch"].items():
            rows.append((f"latency b={bs} (ms)", f"{row['masked']['median_ms']:.2f}", f"{row['slim']['median_ms']:.2f}",
                         f"{row['slim']['ratio']:.3f}"))
    w = max(len(r[0]) for r in rows)
    lines = [f"{'':<{w}}  {'masked':>10}  {'slim':>10}  {'slim/masked':>11}"]
    lines += [f"{a:<{w}}  {b:>10}  {c:>10}  {d:>11}" for a, b, c, d in rows]
    eq, rm = report["equivalence"], report["removed"]
    if lat:
        lines.append(f"(latency: CPU, {lat['threads']} thread(s), median of {lat['repeats']} interleaved repetitions)")
    lines.append(f"same function: max |output difference| {eq['max_abs_diff']:.2e} on {eq['samples']} test images "
                 f"(tolerance {eq['tolerance']:.1e}), same prediction {100 * eq['same_prediction']:.1f}%")
    lines.append(f"channels removed: {rm['removed']} of {rm['channels']} ({rm['unread']} unread, {rm['folded']} "
                 f"constant folded into the next layer's bias, {rm['zero_constant']} constant zero); "
                 f"{rm['kept_constant']} constant channels kept (a padded conv reads them)")
    if rm.get("heads"):
        lines.append(f"attention heads removed: {rm['heads_removed']} of {rm['heads']}")
    lines.append(f"saved {report['out']}: load with {report['load_with']}; report {report.get('json', '')}")
    return "\n".join(lines)
