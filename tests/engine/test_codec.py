"""The payload codec's contract (:mod:`prunex_hvd.engine.codec`): what a leader puts in the compact buckets, how z is
read back, and when a narrow payload's rounding errors are kept."""
import torch

from prunex_hvd.engine import sparsity
from prunex_hvd.engine.codec import ANCHOR_EVERY, PayloadCodec

from components import state as make_state


def _prune_half(s):
    """Masks keeping the first half of every structured entry's rows: a compact payload smaller than the model."""
    for e in s.structured:
        rows = torch.zeros_like(e.rows)
        rows[: len(rows) // 2] = True
        e.set_masks(rows, e.cols.clone())


def _filled(s, seed=1):
    """One round's payload from random candidates z_i (and duals v), with the layout it was put in."""
    torch.manual_seed(seed)
    codec = PayloadCodec(s)
    z_i = [torch.randn_like(e.z) for e in s.entries]
    for e in s.entries:
        e.v.normal_(0, 0.1)
    layout = s.layout((e.compact_numel() for e in s.entries), dtype=codec.round_dtype())
    dense = s.layout([e.param.numel() for e in s.entries])
    for j, (_, b) in enumerate(s.buffers):   # the node's sum of the buffers (one rank: the buffers)
        dense.views[len(s.entries) + j].copy_(b.reshape(-1))
    codec.fill(layout, z_i, dense.views)
    return codec, layout, z_i


def test_a_full_width_payload_reads_back_as_what_was_sent_on_the_support():
    s = make_state(payload_dtype=None)
    _prune_half(s)
    codec, layout, z_i = _filled(s)
    assert not s.delta_coded and layout.total_numel < sum(e.param.numel() for e in s.entries)
    for e, z, sent in zip(s.entries, codec.recover(layout, {}), z_i):
        want = sent + e.v
        want = sparsity.apply_masks(want, e.rows, e.cols) if e.structured else want
        assert torch.equal(z, want), e.name   # exact: shrink and recover move values, nothing else


def test_a_bf16_payload_s_bases_start_at_z_and_an_unknown_base_anchors_the_round():
    s = make_state(payload_dtype="bf16")
    _prune_half(s)
    assert s.delta_coded and s.anchored_at == 0 and all(torch.equal(e.sent, e.z) for e in s.entries)
    assert PayloadCodec(s).round_dtype() == torch.bfloat16   # the first round codes changes against z
    s.anchored_at = None                                     # a state loaded without its bases
    codec, layout, z_i = _filled(s)
    assert codec.anchored and layout.buffers[0].dtype == torch.float32
    for e, z, sent, base in zip(s.entries, codec.recover(layout, {}), z_i, codec.pending):
        want = sent + e.v
        want = sparsity.apply_masks(want, e.rows, e.cols) if e.structured else want
        assert torch.equal(z, want) and torch.equal(base, want), e.name   # the base starts at what was sent
    assert all(not t.any() for t in codec.pending[len(s.entries):])        # the buffers' errors start at zero
    codec.commit()
    assert s.anchored_at == s.round and codec.round_dtype() == torch.bfloat16
    s.round += ANCHOR_EVERY
    assert codec.round_dtype() == torch.float32                            # ANCHOR_EVERY rounds later, again


def _delta_round(s):
    """A state past its anchored round, each entry's base near its coming target (a leader's own sent values)."""
    s.anchored_at = s.round = 1
    for e in s.entries:
        e.sent.copy_(torch.randn_like(e.sent))
    return s


def test_a_bf16_payload_carries_each_leader_s_change_against_its_own_base():
    s = _delta_round(make_state(payload_dtype="bf16"))
    _prune_half(s)
    bases = [e.sent.clone() for e in s.entries]
    codec, layout, z_i = _filled(s)
    assert not codec.anchored and layout.buffers[0].dtype == torch.bfloat16
    z_new = codec.recover(layout, {})
    for e, z, sent, old, new in zip(s.entries, z_new, z_i, bases, codec.pending):
        on = (lambda t: sparsity.apply_masks(t, e.rows, e.cols)) if e.structured else (lambda t: t)  # noqa: E731
        target, change = on(sent + e.v), on(sent + e.v - old)
        # one node: z moves by this leader's rounded change q, and its base moves by the same q
        torch.testing.assert_close(z - on(e.z), new - on(old), rtol=0, atol=1e-6)
        # rounded once, at the change's scale (not the value's): the base is the target to bf16's step of it
        assert float((new - target).abs().max()) <= 2 ** -8 * float(change.abs().max()) + 1e-7
        assert torch.equal(new, on(new)), e.name   # the base lives on the support, as z does
    assert all(torch.equal(e.sent, old) for e, old in zip(s.entries, bases))   # kept once the round is accepted
    pending = list(codec.pending)
    codec.commit()
    assert codec.pending is None and s.anchored_at == 1
    assert all(torch.equal(e.sent, new) for e, new in zip(s.entries, pending))
    assert all(torch.equal(ef, err) for ef, err in zip(s.buffer_ef, pending[len(s.entries):]))


def test_a_refused_round_leaves_the_bases_as_they_were():
    s = _delta_round(make_state(payload_dtype="bf16"))
    codec, _, _ = _filled(s)
    codec.commit()
    kept = [e.sent.clone() for e in s.entries]
    _filled(s, seed=2)   # a new round's payload, never committed (the verdict refused it)
    assert all(torch.equal(e.sent, k) for e, k in zip(s.entries, kept))


def test_the_buffers_travel_as_the_node_mean_and_read_back_as_the_round_average():
    for s in (make_state(payload_dtype="bf16"), _delta_round(make_state(payload_dtype="bf16"))):
        codec, layout, _ = _filled(s)
        for (_, b), avg in zip(s.buffers, codec.decode_buffers(layout)):
            torch.testing.assert_close(avg, b, rtol=2 ** -8, atol=1e-6)   # one node: the mean is its own buffers


def _quadratic_admm(coding, nodes=4, n=2000, rho=1.0, rounds=300):
    """Consensus ADMM on f_i(x) = ½·a_i·(x − b_i)² per node (the x-update exact), the nodes' z_i + v_i averaged
    by ``coding``: "float64", "float32", "bf16" (z_i + v_i rounded), "feedback" (the change z_i + v_i − z with
    error feedback) or "codec" (this module's: each node's change against its own base, from z, and every
    ANCHOR_EVERY rounds whole values in float32). The bf16 payloads are summed in node order in bf16, as the
    transports sum them. Returns z after every round (float64)."""
    from prunex_hvd.engine.codec import code_change, code_with_feedback
    g = torch.Generator().manual_seed(0)
    a = [torch.rand(n, generator=g, dtype=torch.float64) * 2 + 0.1 for _ in range(nodes)]
    b = [torch.randn(n, generator=g, dtype=torch.float64) * 2 for _ in range(nodes)]
    dtype = torch.float64 if coding == "float64" else torch.float32
    z = torch.zeros(n, dtype=dtype)
    v = [torch.zeros(n, dtype=dtype) for _ in range(nodes)]
    kept = [torch.zeros(n, dtype=dtype) for _ in range(nodes)]   # error (feedback) or base (codec)
    zs = []
    for k in range(rounds):
        x = [((a[i] * b[i] + rho * (z.double() - v[i].double())) / (a[i] + rho)).to(dtype) for i in range(nodes)]
        c = [x[i] + v[i] for i in range(nodes)]
        if coding in ("float64", "float32") or (coding == "codec" and k and k % ANCHOR_EVERY == 0):
            z_new = sum(c) / nodes
            kept = [t.clone() for t in c]
        elif coding == "bf16":
            total = c[0].to(torch.bfloat16)
            for t in c[1:]:
                total = total + t.to(torch.bfloat16)
            z_new = total.to(dtype) / nodes
        else:
            qs = []
            for i in range(nodes):
                if coding == "feedback":
                    q, kept[i] = code_with_feedback(c[i].clone(), z, kept[i], torch.bfloat16)
                else:
                    q, kept[i] = code_change(c[i].clone(), kept[i], torch.bfloat16)
                qs.append(q)
            total = qs[0]
            for q in qs[1:]:
                total = total + q
            z_new = z + total.to(dtype) / nodes
        z = z_new
        v = [v[i] + x[i] - z for i in range(nodes)]
        zs.append(z.double())
    return zs


def test_a_bf16_payload_on_exact_quadratic_admm_converges_to_the_float64_consensus():
    """Against float64 on an exact quadratic ADMM problem (4 nodes, 300 rounds), z's relative deviation: the
    codec's coding stays below z_i + v_i sent in bf16 (3e-3): 1.5e-3 until its first anchored round, 1e-6 after it
    and 8e-8 after the second (float32's own: 7e-8). Error feedback against z stays at ~2e-3: a node's change
    z_i + v_i − z tends to its dual v_i, not to zero, and the dual update already carries the rounding (it is
    counted twice)."""
    ref = _quadratic_admm("float64")

    def deviation(coding):
        return [float((z - r).norm() / r.norm()) for z, r in zip(_quadratic_admm(coding), ref)]
    f32, bf16, feedback, codec = (deviation(c) for c in ("float32", "bf16", "feedback", "codec"))
    assert f32[-1] < 1e-7 and bf16[-1] > 1e-3 and feedback[-1] > 1e-3   # the bounds tell the codings apart
    assert all(c <= b for c, b in zip(codec[9:], bf16[9:]))               # no worse than z_i + v_i in bf16
    # each anchored round (128, 256) restarts the bases from whole values: the drift left is smaller each time
    assert max(codec[ANCHOR_EVERY + 20:]) <= 2e-6 < 1e-4 < codec[ANCHOR_EVERY - 1]
    assert codec[-1] <= 2 * f32[-1]
