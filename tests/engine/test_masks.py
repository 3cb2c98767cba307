"""The mask policy's contract (:mod:`prunex_hvd.engine.masks`): Π_S on the node's candidate, the OR of the nodes'
masks and how much they moved, the freeze at exactly the requested structure, and what a refused round puts back."""
import torch

from prunex_hvd.engine import sparsity
from prunex_hvd.engine.config import Structure
from prunex_hvd.engine.masks import MaskPolicy

from components import chain, state as make_state


class OtherNode:
    """The exchange as one node sees it: the masks' OR with another node's ``flat`` masks, or theirs handed down."""

    def __init__(self):
        self.other = None

    def tree_(self, flat, op, tag=None):
        assert op in ("bor", "broadcast") and tag == "masks"
        if self.other is not None and op == "bor":
            flat |= self.other
        elif self.other is not None:   # the other node is rank 0's
            flat.copy_(self.other)
        return flat


def policy(**knobs):
    model = chain()
    s = make_state(model, **knobs)
    return s, MaskPolicy(s, Structure.resolve(model, s.config), OtherNode())


def test_the_projection_keeps_the_requested_channels_and_the_or_keeps_every_node_s():
    s, masks = policy(freeze_round=None, channel_budget="layer")
    z_i = [torch.randn_like(e.z) for e in s.entries]
    own = masks.masks({e.name: z for e, z in zip(s.entries, z_i) if e.structured})
    flip = lambda m: m if bool(m.all()) else ~m   # noqa: E731
    other = [(flip(rows), flip(cols)) for rows, cols in own]   # the other node kept what this one dropped
    masks.exchange.other = torch.cat([torch.cat([r, c]) for r, c in other]).to(torch.uint8)
    masks.project(z_i)
    for e, (rows, cols), z in zip(s.structured, own, [z for e, z in zip(s.entries, z_i) if e.structured]):
        assert bool(e.rows.all()) and bool(e.cols.all())   # the OR of complementary masks keeps everything
        assert not (bool(rows.all()) and bool(cols.all()))   # while this node's own kept half
        assert torch.equal(z, sparsity.apply_masks(z, rows, cols))   # z_i on this node's own projection
    assert s.mask_drift == 0.0 and masks.density() == 1.0   # from all ones to all ones: nothing moved

    masks.exchange.other = None   # the next round, alone: the masks shrink to this node's own
    masks.project([torch.randn_like(e.z) for e in s.entries])
    assert 0.4 < s.mask_drift <= 0.5 and masks.compact is None   # the layout is made again


def test_freezing_cuts_z_to_exactly_the_requested_structure():
    s, masks = policy(freeze_round=None)
    masks.freeze()
    assert s.frozen and abs(masks.density() - 0.5) < 0.05
    for e in s.structured:
        assert torch.equal(e.z, sparsity.apply_masks(e.z, e.rows, e.cols))
    assert masks.retraining and all(torch.equal(m, sparsity.apply_masks(torch.ones_like(e.z), e.rows, e.cols))
                                    for e, m in zip(s.structured, masks.support()))


def test_freezing_is_due_at_its_round_or_after_the_patience_without_a_change():
    s, masks = policy(freeze_round=2, freeze_patience=5)
    s.round = 1
    assert not masks.due()
    s.round = 2
    assert masks.due()
    s, masks = policy(freeze_round=None, freeze_patience=2)
    s.mask_drift = 0.1
    assert not masks.due()
    s.mask_drift = 0.0
    assert not masks.due() and masks.due()   # two rounds without a change


def test_a_refused_round_puts_the_masks_and_the_layout_back():
    s, masks = policy(freeze_round=None)
    layout = masks.compact_layout()
    assert masks.compact_layout() is layout   # made once while the masks hold
    saved = masks.saved()
    masks.project([torch.randn_like(e.z) for e in s.entries])
    assert masks.compact is None and s.mask_drift > 0
    masks.restore(saved)
    assert masks.compact is layout and s.mask_drift == 0.0 and masks.density() == 1.0
