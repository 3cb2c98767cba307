"""Structured masks, the projection Π_S and shrink/recover: pure tensor functions, checked against brute force."""
import itertools
import math

import pytest
import torch
from torch import nn

from prunex_hvd.engine.sparsity import native as native_kernel
from prunex_hvd import sparsity as sparsity_module
from prunex_hvd.engine.buckets import BucketLayout
from prunex_hvd.engine.sparsity import (KernelPlan, GatherPlan, StructureSpec, apply_masks, density, gather_plan, gemm_view,
                                 keep_count, masks_to_indices, parse_spec, project, recover, recover_gather, resolve_specs, shrink,
                                 structured_masks)

SHAPE = (4, 3, 2, 2)   # 4 filters, 3 channels, 12 GEMM columns: every subset enumerable


# ------------------------------------------------------------------------------------------------ specs

def test_parse_canonical_order_and_str():
    s = parse_spec("channel:0.5+filter:0.25")
    assert s.parts == (("filter", 0.25), ("channel", 0.5))
    assert str(s) == "filter:0.25+channel:0.5"
    assert parse_spec(str(s)) == s and hash(parse_spec(str(s))) == hash(s)
    assert parse_spec("  shape : 0.8 +  filter:0.3 ").parts == (("filter", 0.3), ("shape", 0.8))
    assert parse_spec("shape:0.8+channel:1+filter:.3").parts == (("filter", 0.3), ("channel", 1.0), ("shape", 0.8))
    assert str(parse_spec("channel:1.0")) == "channel:1"
    assert parse_spec(s) is s
    # direct construction is validated and canonicalised too
    assert StructureSpec((("shape", 0.5), ("filter", 0.5))).parts == (("filter", 0.5), ("shape", 0.5))


@pytest.mark.parametrize("text", [None, "", "dense", "  Dense ", "   "])
def test_parse_dense_forms(text):
    s = parse_spec(text)
    assert s.is_dense and s.parts == () and str(s) == "dense"
    assert not parse_spec("filter:0.5").is_dense


@pytest.mark.parametrize("text, message", [
    ("row:0.5", r"unknown structure kind 'row'; valid kinds: filter, channel, shape"),
    ("filter:0.5+kernel:0.5", r"unknown structure kind 'kernel'"),
    ("filter", r"'filter' needs a keep ratio"),
    ("filter:", r"'filter' needs a keep ratio"),
    ("channel:abc", r"keep ratio 'abc' of 'channel' is not a number"),
    ("channel:0.5:0.2", r"is not a number"),
    ("channel:0", r"keep ratio must be in \(0, 1\]"),
    ("channel:-0.5", r"keep ratio must be in \(0, 1\]"),
    ("shape:1.5", r"keep ratio must be in \(0, 1\]"),
    ("shape:nan", r"keep ratio must be in \(0, 1\]"),
    ("filter:0.5+filter:0.3", r"'filter' given more than once"),
    ("filter:0.5+", r"an empty part \(parts are joined by '\+'"),
    ("chanel:0.5", r"unknown structure kind 'chanel' \(did you mean 'channel'\?\); valid kinds"),
    ("filter:0.5+nueron:0.5", r"unknown structure kind 'nueron' \(did you mean 'neuron'\?\)"),
    ("dense+filter:0.5", r"unknown structure kind 'dense'"),
])
def test_parse_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(text)


def test_parse_wrong_type():
    with pytest.raises(TypeError, match="sparsity spec must be a str"):
        parse_spec(0.5)
    with pytest.raises(ValueError, match=r"keep ratio must be in \(0, 1\]"):
        StructureSpec((("filter", 2.0),))


# ------------------------------------------------------------------------------------------- keep count

def test_keep_count_float_robust():
    assert keep_count(0.3, 10) == 3          # 0.3*10 may not be exactly 3 in floating point
    assert keep_count(0.1 + 0.2, 10) == 3    # 3.0000000000000004
    assert keep_count(0.7, 10) == 7
    assert keep_count(1 / 3, 3) == 1
    assert keep_count(1 / 3, 300) == 100
    assert keep_count(0.29, 100) == 29 and keep_count(0.57, 100) == 57
    assert keep_count(0.31, 10) == 4         # a real fractional part still rounds up
    assert keep_count(0.5, 7) == 4
    assert keep_count(1e-6, 10) == 1         # never zero
    assert keep_count(1.0, 10) == 10 and keep_count(1.0, 1) == 1
    with pytest.raises(ValueError, match=r"keep ratio must be in \(0, 1\]"):
        keep_count(0.0, 10)
    with pytest.raises(ValueError, match="at least one group"):
        keep_count(0.5, 0)


# ---------------------------------------------------------------------- projection vs brute force

def _groups(kind, shape):
    """Each group of the GEMM view as a boolean mask over (C_out, C_in*KH*KW)."""
    c_out, c_in, kh, kw = shape
    n_cols = c_in * kh * kw
    out = []
    if kind == "filter":
        for i in range(c_out):
            m = torch.zeros(c_out, n_cols, dtype=torch.bool)
            m[i] = True
            out.append(m)
    elif kind == "channel":
        for c in range(c_in):
            m = torch.zeros(c_out, n_cols, dtype=torch.bool)
            m[:, c * kh * kw:(c + 1) * kh * kw] = True
            out.append(m)
    else:
        for j in range(n_cols):
            m = torch.zeros(c_out, n_cols, dtype=torch.bool)
            m[:, j] = True
            out.append(m)
    return out


def _brute_force(w, kind, keep):
    """argmin over every k-subset of groups of ||W - W*mask||_F; first (lexicographically lowest) wins."""
    groups = _groups(kind, w.shape)
    k = math.ceil(keep * len(groups) - 1e-9)
    g = gemm_view(w)
    best, best_err = None, None
    for subset in itertools.combinations(range(len(groups)), k):
        mask = torch.zeros_like(groups[0])
        for i in subset:
            mask |= groups[i]
        err = float((g - g * mask).pow(2).sum())
        if best_err is None or err < best_err:
            best, best_err = (g * mask).reshape(w.shape), err
    return best, best_err


@pytest.mark.parametrize("kind", ["filter", "channel", "shape"])
@pytest.mark.parametrize("keep", [0.25, 0.34, 0.5, 0.7, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_projection_is_frobenius_nearest(kind, keep, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    p = project(w, f"{kind}:{keep}")
    best, best_err = _brute_force(w, kind, keep)
    assert float((w - p).pow(2).sum()) == pytest.approx(best_err, rel=1e-12, abs=1e-15)
    assert torch.equal(p, best)


@pytest.mark.parametrize("kind", ["filter", "channel", "shape"])
def test_ties_keep_lowest_index_brute_force(kind):
    # Integer entries with equal group norms: many minimisers, the lowest-index one must be chosen.
    w = torch.ones(SHAPE)
    w[:, :, 0, 0] = 2.0
    p = project(w, f"{kind}:0.5")
    best, _ = _brute_force(w, kind, 0.5)
    assert torch.equal(p, best)


def test_ties_all_equal_rows_keep_first():
    w = torch.ones(6, 2, 3, 3)
    rows, cols = structured_masks(w, "filter:0.5")
    assert rows.tolist() == [True, True, True, False, False, False] and bool(cols.all())
    rows, cols = structured_masks(w, "channel:0.5")
    assert bool(rows.all()) and cols.tolist() == [True] * 9 + [False] * 9
    # a larger norm later still beats the tie
    w[4] = 2.0
    rows, _ = structured_masks(w, "filter:0.5")
    assert rows.tolist() == [True, True, False, False, True, False]


def test_masks_by_hand():
    w = torch.zeros(3, 2, 1, 2)
    w[0] = 1.0          # row 1 largest, then row 0, then row 2
    w[1] = 1.5
    w[2] = 0.5
    w[:, 1, 0, 1] *= 3  # column 3 (in channel 1) the largest column
    rows, cols = structured_masks(w, "filter:0.5")
    assert rows.tolist() == [True, True, False] and cols.all()
    rows, cols = structured_masks(w, "channel:0.5")
    assert rows.all() and cols.tolist() == [False, False, True, True]
    rows, cols = structured_masks(w, "shape:0.25")
    assert cols.tolist() == [False, False, False, True]


# ----------------------------------------------------------------------------------------- composite

def _topk_ref(norms, k):
    order = sorted(range(len(norms)), key=lambda i: (-norms[i], i))
    keep = set(order[:k])
    return [i in keep for i in range(len(norms))]


def _composite_ref(w, f, c, s):
    """Step by step with Python lists: filter on W, channel on W*rows, shape on W*rows*channel-cols; AND."""
    c_out, c_in, kh, kw = w.shape
    g = gemm_view(w).double().tolist()
    n_cols = c_in * kh * kw
    rows = [True] * c_out
    cols = [True] * n_cols
    if f is not None:
        rows = _topk_ref([sum(x * x for x in g[i]) for i in range(c_out)], keep_count(f, c_out))
    if c is not None:
        norms = [sum(g[i][j] ** 2 for i in range(c_out) if rows[i] for j in range(ch * kh * kw, (ch + 1) * kh * kw))
                 for ch in range(c_in)]
        chm = _topk_ref(norms, keep_count(c, c_in))
        cols = [cols[j] and chm[j // (kh * kw)] for j in range(n_cols)]
    if s is not None:
        norms = [sum(g[i][j] ** 2 for i in range(c_out) if rows[i]) if cols[j] else 0.0 for j in range(n_cols)]
        shm = _topk_ref(norms, keep_count(s, n_cols))
        cols = [a and b for a, b in zip(cols, shm)]
    return rows, cols


@pytest.mark.parametrize("spec, f, c, s", [
    ("filter:0.5+channel:0.5", 0.5, 0.5, None),
    ("channel:0.67+filter:0.25", 0.25, 0.67, None),
    ("shape:0.5+filter:0.75", 0.75, None, 0.5),
    ("channel:0.5+shape:0.6", None, 0.5, 0.6),
    ("shape:0.3+channel:0.75+filter:0.5", 0.5, 0.75, 0.3),
])
@pytest.mark.parametrize("seed", range(4))
def test_composite_is_sequential(spec, f, c, s, seed):
    w = torch.randn(6, 4, 3, 3, generator=torch.Generator().manual_seed(seed))
    rows, cols = structured_masks(w, spec)
    ref_rows, ref_cols = _composite_ref(w, f, c, s)
    assert rows.tolist() == ref_rows and cols.tolist() == ref_cols
    p = project(w, spec)
    support = rows[:, None] & cols[None, :]
    assert torch.equal(gemm_view(p)[support], gemm_view(w)[support])
    assert not bool(gemm_view(p)[~support].any())


def test_composite_ranks_the_masked_matrix():
    # filter keeps row 0 ([1, 2]); ranked on the full matrix channel 0 (1+4) would beat channel 1 (4+0),
    # but on the row-masked matrix channel 1 (2) beats channel 0 (1).
    w = torch.tensor([[1.0, 2.0], [2.0, 0.0]]).reshape(2, 2, 1, 1)
    rows, cols = structured_masks(w, "channel:0.5+filter:0.5")
    assert rows.tolist() == [True, False] and cols.tolist() == [False, True]
    assert project(w, "filter:0.5+channel:0.5").flatten().tolist() == [0.0, 2.0, 0.0, 0.0]


def test_dense_and_non_conv():
    w = torch.randn(5, 3)
    rows, cols = structured_masks(w, "dense")
    assert rows.shape == (5,) and cols.shape == (3,) and rows.all() and cols.all()
    assert torch.equal(project(w, None), w)
    with pytest.raises(ValueError, match=r"needs a conv weight \(4-D.*got shape \(5, 3\)"):
        structured_masks(w, "filter:0.5")


def test_apply_masks_density_indices():
    w = torch.randn(SHAPE)
    w[3, 0, 0, 0] = float("nan")     # dropped below: must become exactly 0, not nan
    rows = torch.tensor([True, False, True, False])
    cols = torch.zeros(12, dtype=torch.bool)
    cols[[1, 5, 6]] = True
    p = apply_masks(w, rows, cols)
    assert p.shape == w.shape and p.dtype == w.dtype and not torch.isnan(p).any()
    assert torch.equal(gemm_view(p)[[0, 2]][:, [1, 5, 6]], gemm_view(w)[[0, 2]][:, [1, 5, 6]])
    assert int((p != 0).sum()) == 6
    assert density(rows, cols) == pytest.approx(6 / 48)
    r, c = masks_to_indices(rows, cols)
    assert r.dtype == torch.int64 and r.tolist() == [0, 2] and c.tolist() == [1, 5, 6]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_ranks_in_float32(dtype):
    w = torch.randn(16, 8, 3, 3) * 300      # squares overflow float16
    wh = w.to(dtype)
    for spec in ["filter:0.5", "channel:0.5+shape:0.5"]:
        rows, cols = structured_masks(wh, spec)
        ref_rows, ref_cols = structured_masks(wh.float(), spec)
        assert torch.equal(rows, ref_rows) and torch.equal(cols, ref_cols)
        p = project(wh, spec)
        assert p.dtype == dtype and torch.isfinite(p).all()


# ------------------------------------------------------------------------------------- shrink / recover

@pytest.mark.parametrize("spec", ["filter:0.5", "channel:0.5", "shape:0.4", "filter:0.5+channel:0.5",
                                  "filter:0.75+shape:0.3", "channel:1", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shrink_recover_roundtrip(spec, dtype):
    w = torch.randn(8, 6, 3, 3, dtype=dtype, generator=torch.Generator().manual_seed(3))
    rows, cols = structured_masks(w, spec)
    r, c = masks_to_indices(rows, cols)
    p = project(w, spec)
    block = shrink(p, r, c)
    assert block.shape == (len(r), len(c)) and block.is_contiguous() and block.dtype == dtype
    assert torch.equal(block, gemm_view(w)[r][:, c])
    assert torch.equal(shrink(w, r, c), block)          # masking first changes nothing
    back = recover(block, r, c, w.shape)
    assert back.shape == w.shape and back.dtype == dtype and torch.equal(back, p)
    assert torch.equal(recover(block.flatten(), r, c, w.shape), p)
    assert torch.equal(shrink(back, r, c), block)


@pytest.mark.parametrize("spec", ["filter:0.5", "channel:0.5", "shape:0.4", "filter:0.5+channel:0.5", "dense"])
def test_shrink_recover_out_into_flat_buffer(spec):
    w = torch.randn(8, 6, 3, 3, generator=torch.Generator().manual_seed(4))
    r, c = masks_to_indices(*structured_masks(w, spec))
    n = len(r) * len(c)
    buf = torch.full((n + 10,), -7.0)
    res = shrink(w, r, c, out=buf[5:5 + n])
    assert res.shape == (len(r), len(c)) and res.data_ptr() == buf[5:].data_ptr()
    assert torch.equal(buf[5:5 + n].view(len(r), len(c)), gemm_view(w)[r][:, c])
    assert bool((buf[:5] == -7).all()) and bool((buf[5 + n:] == -7).all())    # neighbours untouched
    dst = torch.full_like(w, 99.0)      # recover must zero-fill what it does not write
    got = recover(buf[5:5 + n], r, c, w.shape, out=dst)
    assert got is dst and torch.equal(dst, project(w, spec))


def test_shrink_out_casts_and_requires_grad():
    w = torch.randn(4, 4, 3, 3, requires_grad=True)
    r, c = masks_to_indices(*structured_masks(w, "channel:0.5"))
    buf = torch.empty(len(r) * len(c), dtype=torch.float16)
    shrink(w, r, c, out=buf)
    assert torch.equal(buf, gemm_view(w.detach())[r][:, c].half().flatten())
    grad_like = torch.empty(4, 4, 3, 3, requires_grad=True)     # a leaf that requires grad, written in place
    recover(buf, r, c, w.shape, out=grad_like)
    assert torch.allclose(grad_like.detach(), project(w.detach(), "channel:0.5"), atol=1e-2)
    assert shrink(w, r, c).requires_grad      # without out, shrink stays differentiable


def test_recover_non_contiguous_out_and_errors():
    w = torch.randn(4, 3, 2, 2)
    r, c = masks_to_indices(*structured_masks(w, "filter:0.5+shape:0.5"))
    block = shrink(w, r, c)
    base = torch.full((2, 2, 3, 4), 5.0)
    out = base.permute(3, 2, 1, 0)        # shape (4, 3, 2, 2), not contiguous
    recover(block, r, c, w.shape, out=out)
    assert torch.equal(out, project(w, "filter:0.5+shape:0.5"))
    with pytest.raises(ValueError, match="elements"):
        shrink(w, r, c, out=torch.empty(block.numel() + 1))
    with pytest.raises(ValueError, match="contiguous"):
        shrink(w, r, c, out=torch.empty(block.numel() * 2)[::2])
    with pytest.raises(ValueError, match="elements"):
        recover(block.flatten()[1:], r, c, w.shape)
    with pytest.raises(ValueError, match="shape"):
        recover(block, r, c, w.shape, out=torch.empty(4, 12))


def test_dense_params_1d_2d():
    for t in [torch.randn(10), torch.randn(5, 7)]:
        r, c = masks_to_indices(*structured_masks(t, "dense"))
        assert gemm_view(t).shape == (t.shape[0], t.numel() // t.shape[0])
        assert torch.equal(shrink(t, r, c).flatten(), t.flatten())
        buf = torch.zeros(t.numel() + 3)
        shrink(t, r, c, out=buf[3:])
        assert torch.equal(buf[3:], t.flatten())
        assert torch.equal(recover(buf[3:], r, c, t.shape), t)
        assert torch.equal(recover(buf[3:], r, c, t.shape, out=torch.empty_like(t)), t)
    # rows-only subset of a 2-D tensor
    t = torch.randn(5, 7)
    r, c = torch.tensor([1, 3]), torch.arange(7)
    assert torch.equal(shrink(t, r, c), t[[1, 3]])
    back = recover(shrink(t, r, c), r, c, t.shape)
    assert torch.equal(back[[1, 3]], t[[1, 3]]) and not back[[0, 2, 4]].any()


def test_shrink_channel_like_but_unaligned_columns():
    # runs of KH*KW columns that do not start on a channel boundary must not take the per-channel fast path
    w = torch.randn(3, 4, 2, 2)
    r = torch.arange(3)
    for c in [torch.tensor([2, 3, 4, 5]), torch.tensor([0, 1, 2, 4]), torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])]:
        assert torch.equal(shrink(w, r, c), gemm_view(w)[:, c])
        assert torch.equal(shrink(w, r[:2], c, out=torch.empty(2 * len(c))), gemm_view(w)[:2][:, c])
        back = recover(gemm_view(w)[:, c], r, c, w.shape)
        assert torch.equal(gemm_view(back)[:, c], gemm_view(w)[:, c])


# ------------------------------------------------------------------------------------------- resolve

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = nn.Sequential(nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 16, 1))
        self.fc = nn.Linear(16, 10)


def test_resolve_str_hits_conv_weights_only():
    net = Net()
    got = resolve_specs(net.named_parameters(), "channel:0.5")
    assert sorted(got) == ["conv1.weight", "layer1.0.weight", "layer1.2.weight"]
    assert all(s == parse_spec("channel:0.5") for s in got.values())
    assert resolve_specs(net.named_parameters(), None) == {}
    assert resolve_specs(net.named_parameters(), "dense") == {}
    assert resolve_specs(net.named_parameters(), parse_spec("filter:0.5")).keys() == got.keys()


def test_resolve_dict_first_match_wins_and_dense_exclusion():
    net = Net()
    got = resolve_specs(net.named_parameters(), {
        "conv1.*": "dense",                  # spares conv1 although "*" below would match it
        "layer1.2.weight": "filter:0.25",
        "layer1.*": "channel:0.5",           # matches BN / biases too: those are ignored
        "*": "shape:0.5",
    })
    assert got == {"layer1.0.weight": parse_spec("channel:0.5"), "layer1.2.weight": parse_spec("filter:0.25")}
    got = resolve_specs(net.named_parameters(), {"*weight": "filter:0.5", "conv1.weight": "dense"})
    assert sorted(got) == ["conv1.weight", "layer1.0.weight", "layer1.2.weight"]   # first match decides
    # a dense glob may target non-conv parameters without complaint
    assert resolve_specs(net.named_parameters(), {"fc.*": "dense"}) == {}


def test_resolve_errors():
    net = Net()
    with pytest.raises(ValueError, match=r"sparsity glob 'layer9\.\*' matches no parameter"):
        resolve_specs(net.named_parameters(), {"layer9.*": "channel:0.5"})
    with pytest.raises(ValueError, match=r"'fc\.weight' \(shape \(10, 16\)\) is not a conv weight \(4-D\); "
                                         r"filter/channel/shape apply to conv weights only"):
        resolve_specs(net.named_parameters(), {"fc.weight": "channel:0.5"})
    with pytest.raises(ValueError, match=r"is not a conv weight"):
        resolve_specs(net.named_parameters(), {"bn1.*": "filter:0.5", "*": "channel:0.5"})
    with pytest.raises(ValueError, match=r"sparsity\['conv1\.weight'\].*unknown structure kind 'chanel' \(did you "
                                         r"mean 'channel'\?\)"):
        resolve_specs(net.named_parameters(), {"conv1.weight": "chanel:0.5"})
    with pytest.raises(ValueError, match="unknown structure kind"):
        resolve_specs(net.named_parameters(), "chanel:0.5")


class Mixed(nn.Module):
    """A 1-channel stem, a grouped conv (2 channels per group), a depthwise conv, a transposed conv."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=4)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)

    def forward(self, x):
        return self.up(self.depthwise(self.grouped(self.stem(x))))


def test_layer_types_the_gemm_view_does_not_fit_are_refused_by_name():
    net = Mixed()
    # ConvTranspose2d: dim 0 is its input channels, so even 'filter' means something else there
    for spec in ("filter:0.5", "channel:0.5", "shape:0.5"):
        specs = resolve_specs(net.named_parameters(), {"up.*": spec, "*": "dense"})
        with pytest.raises(ValueError, match=r"'up\.weight' belongs to a ConvTranspose2d, whose weight is "
                                             r"\(C_in, C_out/groups, KH, KW\).*'up\.weight': 'dense'"):
            sparsity_module.check_layer_types(net, specs)
    # grouped: 'channel' and 'shape' would drop one position in every group; output filters may go
    specs = resolve_specs(net.named_parameters(), {"grouped.*": "channel:0.5", "*": "dense"})
    with pytest.raises(ValueError, match=r"'grouped\.weight' belongs to a grouped Conv2d \(groups=4, 2 input "
                                         r"channels per group\): 'channel' would drop.*"
                                         r"'grouped\.weight': 'filter:0\.5'"):
        sparsity_module.check_layer_types(net, specs)
    sparsity_module.check_layer_types(net, resolve_specs(net.named_parameters(), {"grouped.*": "filter:0.5",
                                                                                   "*": "dense"}))
    # depthwise: one input channel per filter, so 'channel' can drop nothing (a warning elsewhere), 'shape' can
    sparsity_module.check_layer_types(net, resolve_specs(net.named_parameters(), {"depthwise.*": "channel:0.5",
                                                                                   "*": "dense"}))
    specs = resolve_specs(net.named_parameters(), {"depthwise.*": "filter:0.25+shape:0.5", "*": "dense"})
    with pytest.raises(ValueError, match=r"'depthwise\.weight'.*'shape' would drop.*"
                                         r"'depthwise\.weight': 'filter:0\.25'"):
        sparsity_module.check_layer_types(net, specs)
    # one glob over all of them: every offender named at once, with the dict to write instead
    glob = "channel:0.5"
    with pytest.raises(ValueError) as err:
        sparsity_module.check_layer_types(net, resolve_specs(net.named_parameters(), glob), glob)
    message = str(err.value)
    assert "'grouped.weight'" in message and "'up.weight'" in message and "'depthwise.weight'" not in message
    assert "sparsity={'grouped.weight': 'filter:0.5', 'up.weight': 'dense', '*': 'channel:0.5'}" in message


def test_stages_that_can_remove_nothing():
    shapes = {"stem": (8, 1, 3, 3), "depthwise": (8, 1, 3, 3), "one_filter": (1, 8, 3, 3), "small": (4, 3, 1, 1),
              "plain": (8, 8, 3, 3), "point": (8, 8, 1, 1)}
    specs = {"stem": parse_spec("channel:0.5"), "depthwise": parse_spec("filter:0.5+channel:0.5"),
             "one_filter": parse_spec("filter:0.5+channel:0.5"), "small": parse_spec("channel:0.9"),
             "plain": parse_spec("channel:0.5+shape:0.6"), "point": parse_spec("channel:1+shape:0.5")}
    assert sparsity_module.stages_removing_nothing(shapes, specs) == {
        "stem": ("channel",), "depthwise": ("channel",), "one_filter": ("filter",),
        "small": ("channel",),    # ceil(0.9*3) = 3: all of them
        "plain": ("shape",),      # shape keeps ceil(0.6*72) = 44 columns, the channel stage left 36
    }                             # 'channel:1' asks for nothing: not listed
    assert sparsity_module.stages_removing_nothing({"w": torch.zeros(4, 1, 1, 1)}, {"w": "shape:0.5"}) == \
        {"w": ("shape",)}
    assert sparsity_module.stages_removing_nothing(shapes, {"plain": parse_spec("channel:0.5+shape:0.4")}) == {}


# ---------------------------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_cuda_matches_cpu(dtype):
    w = torch.randn(32, 16, 3, 3, generator=torch.Generator().manual_seed(5)).to(dtype)
    wc = w.cuda()
    for spec in ["filter:0.5", "channel:0.5", "shape:0.3", "filter:0.5+channel:0.5+shape:0.7", "dense"]:
        rows, cols = structured_masks(wc, spec)
        assert rows.is_cuda and cols.is_cuda
        ref = structured_masks(w, spec)
        assert torch.equal(rows.cpu(), ref[0]) and torch.equal(cols.cpu(), ref[1])
        r, c = masks_to_indices(rows, cols)
        assert r.is_cuda
        p = project(wc, spec)
        assert p.is_cuda and torch.equal(p.cpu(), project(w, spec))
        n = len(r) * len(c)
        buf = torch.empty(n + 4, device="cuda", dtype=dtype)
        block = shrink(wc, r, c, out=buf[4:])
        assert torch.equal(block.cpu(), shrink(w, r.cpu(), c.cpu()))
        dst = torch.full_like(wc, 3.0)
        recover(buf[4:], r, c, wc.shape, out=dst)
        assert torch.equal(dst, p) and torch.equal(recover(block, r, c, wc.shape), p)


def test_shrink_non_contiguous_inputs():
    base = torch.randn(16, 6, 3, 3, generator=torch.Generator().manual_seed(6))
    for w in [base[::2], base.to(memory_format=torch.channels_last), base.transpose(2, 3)]:
        ref = w.contiguous()
        for spec in ["channel:0.5", "filter:0.5+channel:0.5", "shape:0.5", "dense"]:
            r, c = masks_to_indices(*structured_masks(w, spec))
            assert torch.equal(structured_masks(w, spec)[1], structured_masks(ref, spec)[1])
            assert torch.equal(shrink(w, r, c), gemm_view(ref)[r][:, c])
            assert torch.equal(shrink(w, r, c, out=torch.empty(len(r) * len(c))).flatten(),
                               gemm_view(ref)[r][:, c].flatten())
            assert torch.equal(project(w, spec), project(ref, spec))


@pytest.mark.parametrize("spec", ["channel:0.5", "filter:0.5+channel:0.3", "shape:0.5", "filter:0.5"])
@pytest.mark.parametrize("native", [True, False])
def test_cached_gather_plan_gives_the_same_blocks(spec, native):
    w = torch.randn(12, 6, 3, 3)
    r, c = masks_to_indices(*structured_masks(w, spec))
    plan = gather_plan(r, c, w.shape, use_kernel=native)
    if native and native_kernel.available():       # on CPU the kernel takes every structure
        assert isinstance(plan, KernelPlan)
    else:                                          # ATen: whole rows or whole kernels only
        assert (plan is not None) == (spec != "shape:0.5")
    block = shrink(w, r, c, plan=plan)
    assert torch.equal(block, shrink(w, r, c))
    out = torch.full((block.numel(),), float("nan"))
    assert torch.equal(shrink(w, r, c, out=out, plan=plan), block)
    full = torch.full_like(w, float("nan"))
    assert torch.equal(recover(block, r, c, w.shape, out=full, plan=plan), recover(block, r, c, w.shape))
    assert torch.equal(recover(block, r, c, w.shape, plan=plan), recover(block, r, c, w.shape))


@pytest.mark.parametrize("shape", [(8, 6, 3, 3), (16, 4, 1, 1), (5, 7, 2, 3)])
@pytest.mark.parametrize("spec", ["channel:0.5", "filter:0.5", "filter:0.5+channel:0.3", "shape:0.5", "channel:0.3",
                                  "filter:0.7+channel:0.5+shape:0.5", "dense"])
def test_recover_gather_from_a_bucket_with_a_zero_tail(shape, spec):
    """recover by one gather reads the block from its bucket slice and pruned chunks from the zero row past the
    bucket's end; the neighbours in the bucket (garbage here) are never read, the tail is never sent."""
    w = torch.randn(shape)
    rows, cols = structured_masks(w, spec)
    r, c = masks_to_indices(rows, cols)
    plan = gather_plan(r, c, w.shape, use_kernel=False)   # the gathers (the kernel's plans: see test_native_*)
    whole_rows = len(c) == cols.numel() and len(r) < rows.numel()
    whole_kernels = len(c) < cols.numel() and shape[2] * shape[3] > 1 and \
        torch.equal(cols.view(shape[1], -1).all(1).repeat_interleave(shape[2] * shape[3]), cols)
    assert (plan is not None) == (whole_rows or whole_kernels)
    if plan is None:
        return
    chunk, slot = plan.chunk, plan.slot
    assert chunk == (cols.numel() if whole_rows else shape[2] * shape[3])
    assert int((slot >= 0).sum()) * chunk == len(r) * len(c)
    assert torch.equal(slot[plan.kept], torch.arange(len(plan.kept)))
    for before in (0, 7, 13):   # the zero row must be found whatever the entry's offset
        layout = BucketLayout([before, len(r) * len(c), 5], torch.float32, "cpu", 1 << 20, zero_tail=2 * chunk)
        for v in layout.views:
            v.copy_(torch.full((v.numel(),), float("nan")))
        assert layout.buffers[0].numel() == before + len(r) * len(c) + 5   # the tail is not in the buffer
        shrink(w, r, c, out=layout.views[1])
        bucket_rows, zero_row = layout.chunk_rows(1, chunk)
        z = recover_gather(bucket_rows, slot.masked_fill(slot < 0, zero_row), w.shape)
        assert torch.equal(z, apply_masks(w, rows, cols))
        assert torch.equal(z, recover(layout.views[1], r, c, w.shape))


def test_chunk_rows_refuses_a_short_tail_or_ragged_rows():
    layout = BucketLayout([9, 5], torch.float32, "cpu", 1 << 20, zero_tail=9)
    with pytest.raises(ValueError, match="too short"):
        layout.chunk_rows(0, 9)    # the buffer ends 5 into a row: the zero row needs up to 2*9-1
    with pytest.raises(ValueError, match="whole number"):
        layout.chunk_rows(1, 4)
    assert BucketLayout([9, 5], torch.float32, "cpu", 1 << 20, zero_tail=17).chunk_rows(0, 9)[1] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", ["channel:0.5", "filter:0.5", "filter:0.5+channel:0.3", "shape:0.5",
                                  "filter:0.7+channel:0.5+shape:0.5"])
def test_cuda_gather_plan_every_structure(spec):
    """On CUDA every structure gets a plan (single elements where columns are not whole rows): shrink and
    recover are one gather each, with the same blocks and tensors as the CPU paths."""
    w = torch.randn(16, 8, 3, 3)
    rows, cols = structured_masks(w, spec)
    r, c = masks_to_indices(rows, cols)
    wc, rc, cc = w.cuda(), r.cuda(), c.cuda()
    plan = gather_plan(rc, cc, w.shape)
    assert plan is not None and plan.slot.is_cuda
    layout = BucketLayout([5, len(r) * len(c), 3], torch.float32, "cuda", 1 << 20, zero_tail=2 * plan.chunk)
    for v in layout.views:
        v.fill_(float("nan"))
    shrink(wc, rc, cc, out=layout.views[1], plan=plan)
    assert torch.equal(layout.views[1].cpu().view(len(r), len(c)), shrink(w, r, c))
    bucket_rows, zero_row = layout.chunk_rows(1, plan.chunk)
    z = recover_gather(bucket_rows, plan.slot.masked_fill(plan.slot < 0, zero_row), w.shape)
    assert torch.equal(z.cpu(), apply_masks(w, rows, cols))
    assert torch.equal(recover(layout.views[1], rc, cc, w.shape, plan=plan).cpu(), apply_masks(w, rows, cols))


def _budget_case(seed=0):
    """Three conv layers of very different weight scales, a linear held by feature, one by neuron (not in it)."""
    g = torch.Generator().manual_seed(seed)
    weights = {"stem": torch.randn(8, 3, 3, 3, generator=g), "mid": 0.2 * torch.randn(16, 8, 3, 3, generator=g),
               "wide": 0.05 * torch.randn(32, 16, 3, 3, generator=g), "head": torch.randn(10, 32, generator=g),
               "mlp": torch.randn(6, 10, generator=g)}
    specs = {"stem": "channel:0.5", "mid": "channel:0.5", "wide": "channel:0.25", "head": "feature:0.5",
             "mlp": "neuron:0.5"}
    return weights, specs


@pytest.mark.parametrize("seed,floor", [(0, 0.1), (1, 0.1), (2, 0.5), (3, 1.0)])
def test_budget_channels_match_the_reference_and_stay_within_the_per_layer_budget(seed, floor):
    from reference import reference_budget
    from prunex_hvd.engine.sparsity import budget_channels, keep_count
    weights, specs = _budget_case(seed)
    got = budget_channels(weights, specs, floor)
    want = reference_budget(weights, specs, floor)
    assert set(got) == set(want) == {"stem", "mid", "wide", "head"}
    for name in got:
        assert torch.equal(got[name], want[name]), name
    per_channel = {n: weights[n].numel() // weights[n].shape[1] for n in got}
    budget = sum(keep_count(float(specs[n].split(":")[1]), weights[n].shape[1]) * per_channel[n] for n in got)
    assert sum(int(got[n].sum()) * per_channel[n] for n in got) <= budget
    for n in got:   # the floor, and never more than a layer has
        assert keep_count(min(floor, float(specs[n].split(":")[1])), weights[n].shape[1]) <= int(got[n].sum())
    if floor < 0.5:   # the small-weight layer gives channels up to the large-weight ones
        assert int(got["stem"].sum()) == 3 and int(got["wide"].sum()) < keep_count(0.25, 16)
    if floor == 1.0:   # every layer at its floor, capped by its own keep: the per-layer projection
        assert [int(got[n].sum()) for n in got] == [2, 4, 4, 16]


def test_budget_channels_keep_at_least_a_tenth_of_every_layer_by_default():
    from prunex_hvd.engine.sparsity import budget_channels
    from prunex_hvd.engine.sparsity.projection import BUDGET_FLOOR
    weights, specs = _budget_case()
    got, tenth, half = (budget_channels(weights, specs, *floor) for floor in ((), (0.1,), (0.5,)))
    assert BUDGET_FLOOR == 0.1 and all(torch.equal(got[n], tenth[n]) for n in got)
    assert not all(torch.equal(got[n], half[n]) for n in got)   # (the floor decides here)


def test_budget_channels_ties_go_to_the_earlier_layer_then_the_lower_index():
    from prunex_hvd.engine.sparsity import budget_channels
    weights = {"a": torch.ones(2, 4, 1, 1), "b": torch.ones(2, 4, 1, 1)}   # every channel of the same density
    got = budget_channels(weights, {"a": "channel:0.5", "b": "channel:0.5"}, 0.25)
    assert got["a"].tolist() == [True, True, True, False] and got["b"].tolist() == [True, False, False, False]


def test_budget_channels_refuse_a_layer_with_other_stages_and_a_bad_floor():
    from prunex_hvd.engine.sparsity import budget_channels, coupled_masks
    weights, specs = _budget_case()
    with pytest.raises(ValueError, match="mid is held to 'filter:0.5\\+channel:0.5'"):
        budget_channels(weights, dict(specs, mid="filter:0.5+channel:0.5"), 0.1)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="budget floor must be a fraction in"):
            budget_channels(weights, specs, bad)
    channels = budget_channels(weights, specs, 0.1)
    with pytest.raises(ValueError, match="mid's input channels are given and also decided by a coupled pair"):
        coupled_masks(weights, specs, {"mid": "stem"}, channels=channels)
    masks = coupled_masks(weights, specs, {}, channels=channels)
    assert torch.equal(masks["mid"][1], channels["mid"].repeat_interleave(9))
    assert masks["mlp"][0].sum() == 3   # not in the budget: its own neuron stage


def test_own_channel_layers_leave_out_grouped_and_composite_layers():
    from prunex_hvd.engine.sparsity import own_channel_layers
    specs = {"a": "channel:0.5", "b": "channel:0.5", "c": "filter:0.5+channel:0.5", "d": "feature:0.5",
             "e": "neuron:0.5", "f": "channel:0.5", "g": "shape:0.5"}
    assert own_channel_layers(specs) == ["a", "b", "d", "f"]
    # a coupled pair (b reads a) and a residual stream (read by f, written by a) choose with other layers
    assert own_channel_layers(specs, {"b": "a"}, [(("f",), ("a",))]) == ["d"]
    assert own_channel_layers(specs, {"b": "a"}) == ["d", "f"]


def test_budget_channels_a_channel_that_does_not_fit_leaves_the_room_to_smaller_ones():
    """The ranking's first channel left, of a large layer, does not fit in what the budget has left; the small
    layer's after it do (a prefix of the ranking would stop there and leave the budget unspent)."""
    from reference import reference_budget
    from prunex_hvd.engine.sparsity import budget_channels
    small = torch.tensor([9.0, 8.0, 3.0, 2.5, 1.0, 1.0, 1.0, 1.0]).sqrt().view(1, 8, 1, 1)   # 1 weight a channel
    large = torch.full((1, 4, 3, 3), 0.5 ** 0.5)                                          # 9 weights a channel
    large[0, 0], large[0, 1] = 10.0 ** 0.5, 5.0 ** 0.5
    weights, specs = {"large": large, "small": small}, {"large": "channel:0.25", "small": "channel:0.5"}
    # floors: large's channel 0 (all of its ceil(0.25·4) = 1), small's 0 and 1; left: 2 of small's 4 weights.
    # Next by mean square: large's channel 1 (5.0, 9 weights) does not fit; small's 2 and 3 (3.0, 2.5) do
    got = budget_channels(weights, specs, 0.25)
    assert got["large"].tolist() == [True, False, False, False]
    assert got["small"].tolist() == [True] * 4 + [False] * 4
    want = reference_budget(weights, specs, 0.25)
    assert all(torch.equal(got[n], want[n]) for n in got)
