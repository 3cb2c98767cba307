"""The payload codec's contract (:mod:`prunex_hvd.engine.codec`): what a leader puts in the compact buckets, how z is
read back, and when a narrow payload's rounding errors are kept."""
import torch

from prunex_hvd.engine import sparsity
from prunex_hvd.engine.codec import PayloadCodec

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
    layout = s.layout((e.compact_numel() for e in s.entries), dtype=s.payload_dtype)
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


def test_a_bf16_payload_carries_the_change_and_keeps_its_rounding_error_for_the_next_round():
    s = make_state(payload_dtype="bf16")
    _prune_half(s)
    codec, layout, z_i = _filled(s)
    assert s.delta_coded and layout.buffers[0].dtype == torch.bfloat16
    z_new = codec.recover(layout, {})
    for e, z, sent, err in zip(s.entries, z_new, z_i, codec.pending):
        target = sent + e.v
        # sent = round(target − z + ef); err = what the rounding dropped: z + sent + err = target + ef, on the support
        want = target if not e.structured else sparsity.apply_masks(target, e.rows, e.cols)
        torch.testing.assert_close(z + err, want, rtol=0, atol=1e-6)
        assert float((z - want).abs().max()) <= 2 ** -8 * float(want.abs().max()) + 1e-7   # bf16's step
        if e.structured:   # the error lives on the support, as z does
            assert torch.equal(err, sparsity.apply_masks(err, e.rows, e.cols))
    assert all(not e.ef.any() for e in s.entries)   # kept only once the round is accepted
    pending = list(codec.pending)
    codec.commit()
    assert codec.pending is None
    assert all(torch.equal(e.ef, err) for e, err in zip(s.entries, pending))
    assert all(torch.equal(ef, err) for ef, err in zip(s.buffer_ef, pending[len(s.entries):]))


def test_a_refused_round_leaves_the_errors_as_they_were():
    s = make_state(payload_dtype="bf16")
    codec, _, _ = _filled(s)
    codec.commit()
    kept = [e.ef.clone() for e in s.entries]
    _filled(s, seed=2)   # a new round's payload, never committed (the verdict refused it)
    assert all(torch.equal(e.ef, k) for e, k in zip(s.entries, kept))


def test_the_buffers_travel_as_the_node_mean_and_read_back_as_the_round_average():
    s = make_state(payload_dtype="bf16")
    codec, layout, _ = _filled(s)
    for (_, b), avg in zip(s.buffers, codec.decode_buffers(layout)):
        torch.testing.assert_close(avg, b, rtol=2 ** -8, atol=1e-6)   # one node: the mean is its own buffers
