"""What `prunex-hvd export` makes of a channel-pruned model: parameters, FLOPs and CPU latency, masked vs slim;
prints JSON.

    python benchmarks/bench_export.py [--model resnet18] [--spec channel:0.5] [--repeats 10] [--threads 1]
    python benchmarks/bench_export.py --run runs/NAME          # a trained run's final model instead

Without ``--run`` the structured weights of a freshly built model are projected exactly as the engine's
``finalize()`` leaves them (``--model vit_tiny --spec head:0.5+neuron:0.5 --modes per-layer,coupled`` for a
transformer), per mask mode:

* ``per-layer``: ``sparsity.project`` on each conv (``coupled=False``);
* ``coupled``: ``sparsity.coupled_project`` along ``dependencies.channel_couplings`` (``coupled=True``);
* ``streams``: the same and ``dependencies.channel_streams`` (``coupled="streams"``): every conv reading or
  writing one residual stream shares one channel set, ranked by the joint norm over all of them;
* ``global``: per layer, the channels of one budget across the layers (``channel_budget="global"``, the
  command line's recipe; ``sparsity.budget_channels``): as many weights kept, more of the early layers'.

The shapes that survive depend on the masks only (how many channels each layer keeps is fixed by the spec);
which channels of a residual stream happen to line up across its readers depends on the weights, so a
trained model can differ a little from these figures. BatchNorm gets trained-like statistics, which matters
only where filters die (filter specs), and so do linear biases. Latency: the masked model and every slim model run interleaved in one
process, batch 1 and 64, median of ``--repeats``; ``ratio`` is slim / masked.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchjson import emit  # noqa: E402

from prunex_hvd import sparsity  # noqa: E402
from prunex_hvd.app import export, models  # noqa: E402
from prunex_hvd.engine.config import ConsensusConfig, Structure  # noqa: E402


MODES = {"per-layer": False, "coupled": True, "streams": "streams", "global": False}


def masked_model(name: str, spec: str, mode: str, seed: int) -> nn.Module:
    """``name`` built and projected onto ``spec`` as ``finalize()`` leaves it, with ``coupled`` as ``mode`` says
    (heads, for a transformer, are one group in every mode). Biases get trained-like values too: a pruned
    neuron is then a constant GELU(b), not a zero."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: {', '.join(MODES)}")
    torch.manual_seed(seed)
    model = models.trained_like_batchnorm(models.build(name), seed).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.3)
    structure = Structure.resolve(model, ConsensusConfig(sparsity=spec, coupled=MODES[mode]))
    ws = {n: p for n, p in model.named_parameters() if n in structure.specs}
    budget = sparsity.own_channel_layers(structure.specs) if mode == "global" else []
    channels = sparsity.budget_channels({n: ws[n] for n in budget}, {n: structure.specs[n] for n in budget}) \
        if budget else None
    new = sparsity.coupled_project(ws, structure.specs, structure.couplings, structure.streams, structure.heads,
                                   channels)
    with torch.no_grad():
        for n, w in new.items():
            ws[n].copy_(w)
    return model


def figures(masked: nn.Module, small: nn.Module, removed: dict, x1: torch.Tensor) -> dict:
    m, s = export.count_params(masked), export.count_params(small)
    zeros = m["params"] - m["params_nonzero"]
    return {"params_masked": m["params"], "params_nonzero_masked": m["params_nonzero"], "params_slim": s["params"],
            "params_nonzero_slim": s["params_nonzero"], "params_ratio": s["params"] / m["params"],
            # of the zeros the masks put in, the share the slim model no longer carries
            "zeros_removed_share": 1 - (s["params"] - s["params_nonzero"]) / zeros if zeros else 0.0,
            "flops_masked": export.count_flops(masked, x1), "flops_slim": export.count_flops(small, x1),
            "flops_ratio": export.count_flops(small, x1) / export.count_flops(masked, x1),
            "removed": {k: v for k, v in removed.items() if k not in ("groups", "attention")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--spec", default="channel:0.5")
    ap.add_argument("--modes", default="per-layer,coupled,streams")
    ap.add_argument("--run", default=None, help="a trained run folder: export its final model instead")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.batch_sizes.split(",")]

    if args.run:
        masked, blob = export.load_run_model(args.run)
        shape = (blob["in_channels"], blob["image_size"], blob["image_size"])
        variants = {"run": masked}
    else:
        shape = (3, args.image_size, args.image_size)
        variants = {mode: masked_model(args.model, args.spec, mode, args.seed)
                    for mode in args.modes.split(",")}
    gen = torch.Generator().manual_seed(args.seed)
    calib = torch.randn((32, *shape), generator=gen)
    doc = {"model": args.model if not args.run else blob["model"], "spec": args.spec if not args.run else blob.get(
        "sparsity"), "input_shape": list(shape), "threads": args.threads, "modes": {}}
    timed = {}
    for mode, masked in variants.items():
        small, removed = export.slim(masked, calib[:2], calibration=calib)
        doc["modes"][mode] = figures(masked, small, removed, calib[:1])
        timed.setdefault("masked", masked)   # every masked variant runs the same dense kernels
        timed[f"slim:{mode}"] = small
    lat = export.measure_latency(timed, shape, sizes, args.repeats)
    doc["latency"] = lat
    for mode in variants:
        doc["modes"][mode]["latency_ratio"] = {bs: row[f"slim:{mode}"]["ratio"] for bs, row in lat["batch"].items()}
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
