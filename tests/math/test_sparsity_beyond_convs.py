"""Structures beyond convs: ``neuron:K`` / ``feature:K`` on linear weights, MLP hidden units coupled across fc1 and
fc2, and ``head:K`` across an attention module's q/k/v and output projections. Each projection against brute
force (every subset enumerated: the masks must be the Frobenius-nearest point of the set), the specs as they
resolve on real models, and shrink/recover of the masks they make."""
import itertools
import math

import pytest
import torch
from torch import nn

from prunex_hvd import ConsensusConfig
from prunex_hvd.app import models
from prunex_hvd.engine import dependencies
from prunex_hvd.engine.config import Structure
from prunex_hvd.engine.dependencies import HeadGroup, attention_heads, structure_targets
from prunex_hvd.engine.sparsity import (apply_masks, coupled_masks, gather_plan, head_masks, masks_to_indices,
                                        parse_spec, recover, resolve_specs, shrink, structured_masks)
from prunex_hvd.engine.sparsity import native as native_kernel


def _nearest(candidates, error):
    """The candidate of least error; ``ValueError`` unless it is the only one within float noise of it."""
    errs = [(error(c), c) for c in candidates]
    best = min(e for e, _ in errs)
    near = [c for e, c in errs if e <= best + 1e-9 * max(1.0, best)]
    assert len(near) == 1, "a tie: pick another seed"
    return near[0]


# ------------------------------------------------------------------------------- neurons and features

@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind,keep", [("neuron", 0.5), ("neuron", 0.3), ("feature", 0.5), ("feature", 0.7)])
def test_linear_projection_is_frobenius_nearest(kind, keep, seed):
    w = torch.randn(6, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    n = w.shape[0] if kind == "neuron" else w.shape[1]
    k = math.ceil(keep * n)

    def error(kept):
        m = torch.zeros(n, dtype=torch.bool)
        m[list(kept)] = True
        cut = w * (m[:, None] if kind == "neuron" else m[None, :])
        return float((w - cut).pow(2).sum())
    best = _nearest(itertools.combinations(range(n), k), error)
    rows, cols = structured_masks(w, f"{kind}:{keep}")
    mask = rows if kind == "neuron" else cols
    assert mask.nonzero().flatten().tolist() == list(best)
    assert (cols if kind == "neuron" else rows).all()


def test_neuron_then_feature_ranks_the_masked_matrix():
    # neuron keeps row 0 ([1, 2]); on the full matrix feature 0 (1+4) would beat feature 1 (4+0), on row 0 alone
    # feature 1 (2) beats feature 0 (1)
    w = torch.tensor([[1.0, 2.0], [2.0, 0.0]])
    rows, cols = structured_masks(w, "feature:0.5+neuron:0.5")
    assert rows.tolist() == [True, False] and cols.tolist() == [False, True]
    assert str(parse_spec("feature:0.5+neuron:0.5")) == "neuron:0.5+feature:0.5"


def test_kinds_on_the_wrong_weights_are_refused():
    with pytest.raises(ValueError, match=r"needs a linear weight \(2-D.*got shape \(4, 3, 2, 2\)"):
        structured_masks(torch.randn(4, 3, 2, 2), "neuron:0.5")
    with pytest.raises(ValueError, match=r"needs a conv weight"):
        structured_masks(torch.randn(4, 3), "channel:0.5")
    with pytest.raises(ValueError, match=r"'head:K' prunes an attention module's heads"):
        structured_masks(torch.randn(4, 3), "head:0.5")


# ---------------------------------------------------------------------------------------- MLP pairs

@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("keep", [0.5, 0.25])
def test_coupled_hidden_units_are_frobenius_nearest(seed, keep):
    """fc1 (hidden × d) and fc2 (d × hidden): hidden unit j is fc1's row j and fc2's column j; kept or dropped
    together, the nearest point drops the units of least joint norm."""
    g = torch.Generator().manual_seed(seed)
    fc1, fc2 = torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randn(5, 8, generator=g, dtype=torch.float64)
    weights = {"fc1": fc1, "fc2": fc2}
    k = math.ceil(keep * 8)

    def error(kept):
        m = torch.zeros(8, dtype=torch.bool)
        m[list(kept)] = True
        return float((fc1 * ~m[:, None]).pow(2).sum() + (fc2 * ~m[None, :]).pow(2).sum())
    best = list(_nearest(itertools.combinations(range(8), k), error))
    masks = coupled_masks(weights, {"fc1": parse_spec(f"neuron:{keep}"), "fc2": parse_spec(f"feature:{keep}")},
                          {"fc2": "fc1"})
    assert masks["fc1"][0].nonzero().flatten().tolist() == best and masks["fc1"][1].all()
    assert masks["fc2"][1].nonzero().flatten().tolist() == best and masks["fc2"][0].all()


def test_mlp_pairs_are_found_and_a_layernorm_is_no_pair():
    net = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.1), nn.Linear(8, 4), nn.LayerNorm(4),
                        nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    assert dependencies.channel_couplings(net) == {"3.weight": "0.weight", "7.weight": "5.weight"}
    vit = models.build("vit_tiny")
    assert dependencies.channel_couplings(vit) == {f"blocks.{i}.mlp.fc2.weight": f"blocks.{i}.mlp.fc1.weight"
                                                   for i in range(4)}


# --------------------------------------------------------------------------------------------- heads

def _group_weights(packed, heads=3, head_dim=2, dim=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = heads * head_dim
    if packed:
        weights = {"in_proj": torch.randn(3 * e, dim, generator=g, dtype=torch.float64)}
        rows = (("in_proj", 3),)
    else:
        weights = {n: torch.randn(e, dim, generator=g, dtype=torch.float64) for n in "qkv"}
        rows = tuple((n, 1) for n in "qkv")
    weights["out"] = torch.randn(dim, e, generator=g, dtype=torch.float64)
    return weights, HeadGroup("attn", heads, rows, ("out",))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("keep", [0.34, 0.5, 0.67])
def test_head_projection_is_frobenius_nearest(packed, keep, seed):
    weights, group = _group_weights(packed, heads=3, seed=seed)
    hd = 2

    def cut(kept):
        out = {}
        for n, w in weights.items():
            m = torch.zeros_like(w, dtype=torch.bool)
            for h in kept:
                if n == "out":
                    m[:, h * hd:(h + 1) * hd] = True
                else:
                    for b in range(w.shape[0] // (3 * hd)):
                        m[(b * 3 + h) * hd:(b * 3 + h + 1) * hd] = True
            out[n] = w * m
        return out
    best = _nearest(itertools.combinations(range(3), math.ceil(keep * 3)),
                    lambda kept: sum(float((weights[n] - c).pow(2).sum()) for n, c in cut(kept).items()))
    masks = head_masks(weights, group, keep)
    want = cut(best)
    for n, (rows, cols) in masks.items():
        assert torch.equal(apply_masks(weights[n], rows, cols), want[n]), n
    # and through the coupled entry point, as the engine calls it
    specs = {n: parse_spec(f"head:{keep}") for n in weights}
    via = coupled_masks(weights, specs, {}, (), [group])
    assert all(torch.equal(via[n][0], masks[n][0]) and torch.equal(via[n][1], masks[n][1]) for n in weights)


def test_heads_are_found_in_every_form():
    packed = nn.MultiheadAttention(8, 2)
    separate = nn.MultiheadAttention(8, 4, kdim=6, vdim=5)
    assert attention_heads(nn.ModuleDict({"a": packed, "b": separate})) == [
        HeadGroup("a", 2, (("a.in_proj_weight", 3),), ("a.out_proj.weight",)),
        HeadGroup("b", 4, (("b.q_proj_weight", 1), ("b.k_proj_weight", 1), ("b.v_proj_weight", 1)),
                  ("b.out_proj.weight",))]
    vit = models.build("vit_tiny")
    groups = attention_heads(vit)
    assert [g.module for g in groups] == [f"blocks.{i}.attn" for i in range(4)]
    assert groups[0].rows == tuple((f"blocks.0.attn.{n}.weight", 1) for n in "qkv")
    assert groups[0].cols == ("blocks.0.attn.proj.weight",) and groups[0].num_heads == 4

    class Timm(nn.Module):   # timm's layout: a packed qkv Linear and proj
        def __init__(self):
            super().__init__()
            self.num_heads, self.qkv, self.proj = 3, nn.Linear(6, 18), nn.Linear(6, 6)
    assert attention_heads(Timm()) == [HeadGroup("", 3, (("qkv.weight", 3),), ("proj.weight",))]

    class Uneven(Timm):   # 6 features do not split into 4 heads: skipped, not guessed
        def __init__(self):
            super().__init__()
            self.num_heads = 4
    assert attention_heads(Uneven()) == []


def test_a_transformer_encoder_layer_has_its_heads_found():
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True)
    targets = structure_targets(layer)
    assert [g.module for g in targets.heads] == ["self_attn"]
    specs = resolve_specs(layer.named_parameters(), "head:0.5", targets)
    assert set(specs) == {"self_attn.in_proj_weight", "self_attn.out_proj.weight"}


# ------------------------------------------------------------------------------------ specs on models

def test_one_spec_on_a_vit_holds_heads_and_mlp_hidden_layers_only():
    vit = models.build("vit_tiny")
    specs = resolve_specs(vit.named_parameters(), "head:0.5+neuron:0.5+channel:0.5", structure_targets(vit))
    assert {n: str(s) for n, s in specs.items() if "blocks.0." in n or "blocks" not in n} == {
        "patch_embed.weight": "channel:0.5",
        **{f"blocks.0.attn.{n}.weight": "head:0.5" for n in ("q", "k", "v", "proj")},
        "blocks.0.mlp.fc1.weight": "neuron:0.5"}   # never the classifier, fc2 or a stream's projection
    assert len(specs) == 1 + 4 * 5
    specs = resolve_specs(vit.named_parameters(), "feature:0.25", structure_targets(vit))
    assert specs == {f"blocks.{i}.mlp.fc2.weight": parse_spec("feature:0.25") for i in range(4)}


def test_a_dict_names_linear_layers_and_each_takes_the_parts_it_can_hold():
    vit = models.build("vit_tiny")
    targets = structure_targets(vit)
    specs = resolve_specs(vit.named_parameters(), {"head.weight": "dense", "*.mlp.fc2.weight": "neuron:0.5",
                                                   "*attn*": "head:0.75", "*": "filter:0.5+feature:0.5"}, targets)
    assert str(specs["blocks.1.mlp.fc2.weight"]) == "neuron:0.5"
    assert str(specs["blocks.1.attn.q.weight"]) == "head:0.75"
    assert str(specs["patch_embed.weight"]) == "filter:0.5" and str(specs["blocks.1.mlp.fc1.weight"]) == "feature:0.5"
    assert "head.weight" not in specs


def test_specs_beyond_convs_refused_with_the_reason():
    vit, cnn = models.build("vit_tiny"), models.build("resnet_small")
    with pytest.raises(ValueError, match=r"'head:K' needs attention modules .* this model has none"):
        resolve_specs(cnn.named_parameters(), "head:0.5", structure_targets(cnn))
    with pytest.raises(ValueError, match=r"'neuron:K' prunes the hidden layers of MLPs .* this model has none"):
        resolve_specs(cnn.named_parameters(), "neuron:0.5", structure_targets(cnn))
    with pytest.raises(ValueError, match=r"'fc\.weight' \(shape \(10, 64\)\) is not an nn.Linear weight|"
                                         r"'conv1\.weight' .* is not an nn\.Linear weight"):
        resolve_specs(cnn.named_parameters(), {"conv1.weight": "neuron:0.5"}, structure_targets(cnn))
    with pytest.raises(ValueError, match=r"is not a projection of an attention module"):
        resolve_specs(vit.named_parameters(), {"*fc1.weight": "head:0.5"}, structure_targets(vit))
    with pytest.raises(ValueError, match=r"attention 'blocks\.0\.attn': a head is pruned from all of"):
        resolve_specs(vit.named_parameters(), {"blocks.0.attn.q.weight": "head:0.5", "*attn*": "head:0.25"},
                      structure_targets(vit))
    with pytest.raises(ValueError, match=r"need the model's layers"):
        resolve_specs(vit.named_parameters(), "neuron:0.5")


def test_coupled_makes_each_mlp_one_group_of_hidden_units():
    vit = models.build("vit_tiny")
    structure = Structure.resolve(vit, ConsensusConfig(sparsity="head:0.5+neuron:0.5", coupled=True))
    assert structure.couplings == {f"blocks.{i}.mlp.fc2.weight": f"blocks.{i}.mlp.fc1.weight" for i in range(4)}
    assert str(structure.specs["blocks.2.mlp.fc2.weight"]) == "feature:0.5"   # the reader's side of the group
    assert [g.module for g in structure.heads] == [f"blocks.{i}.attn" for i in range(4)]
    alone = Structure.resolve(vit, ConsensusConfig(sparsity="neuron:0.5"))
    assert "blocks.2.mlp.fc2.weight" not in alone.specs and alone.heads == ()


# ------------------------------------------------------------------------------------ shrink / recover

@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("packed", [True, False])
def test_shrink_recover_head_and_neuron_masks(native, packed):
    if native and not native_kernel.available():
        pytest.skip("the native kernel is not built here")
    weights, group = _group_weights(packed, heads=4, head_dim=3, dim=7, seed=3)
    masks = head_masks({n: w.float() for n, w in weights.items()}, group, 0.5)
    fc1 = torch.randn(16, 7)
    masks["fc1"] = structured_masks(fc1, "neuron:0.5+feature:0.5")
    weights["fc1"] = fc1
    for n, (rows, cols) in masks.items():
        w = weights[n].float()
        r, c = masks_to_indices(rows, cols)
        plan = gather_plan(r, c, w.shape, use_kernel=native)
        block = shrink(w, r, c, plan=plan)
        assert torch.equal(block, w[r][:, c])
        assert torch.equal(recover(block, r, c, w.shape, plan=plan), apply_masks(w, rows, cols)), n
        full = torch.full_like(w, float("nan"))
        assert torch.equal(recover(block, r, c, w.shape, out=full, plan=plan), apply_masks(w, rows, cols)), n


def test_torchvision_vit_b_16_has_its_heads_and_mlps_found():
    try:
        import torchvision  # noqa: F401
    except Exception:   # not installed, or built for another torch: optional, GPU hosts only
        pytest.skip("torchvision is an optional extra (GPU hosts)")
    model = models.build("torchvision:vit_b_16")
    targets = structure_targets(model)
    assert len(targets.heads) == 12 and {g.num_heads for g in targets.heads} == {12}
    assert all(g.rows[0][1] == 3 for g in targets.heads)   # nn.MultiheadAttention's packed in_proj_weight
    assert len(targets.hidden) == 12                         # every encoder block's MLP
    specs = resolve_specs(model.named_parameters(), "head:0.5+neuron:0.5", targets)
    assert len(specs) == 12 * 3
