"""The verdict's contract (:mod:`prunex_hvd.engine.verdict`): one job-wide sum carries every rank's round, step
count and inf/NaN flags with the residuals, and a round is refused on every rank alike, naming who and what."""
import pytest
import torch

from prunex_hvd.engine.buckets import BucketLayout
from prunex_hvd.engine.verdict import Verdict, nonfinite

from components import state as make_state, topology


class JobSum:
    """The exchange's job-wide sum, with the other rank's contribution made by ``other`` (the same vector as this
    rank's, for the other rank's row)."""

    def __init__(self, other):
        self.other = other

    def sum_over_job(self, local):
        return local + self.other(local)


def verdict_of(s, other_steps=3, other_round=None, other_bad=False):
    """This rank among others at ``other_round`` (this round by default) after ``other_steps`` steps."""
    n, size = len(s.entries), s.topo.size

    def other(local):
        out = torch.zeros_like(local)
        who = out[3 * n: 3 * n + 3 * size].view(size, 3)
        for r in range(size):
            if r != s.topo.rank:
                who[r] = torch.tensor([s.round + 1 if other_round is None else other_round, other_steps,
                                       float(other_bad)])
        if other_bad:
            out[3 * n + 3 * size] = 1.0   # its first entry
        return out
    return Verdict(s, JobSum(other))


def round_inputs(s):
    z = [e.z.clone() for e in s.entries]
    return z, z, [False] * (len(s.entries) + 1), [torch.zeros((), dtype=torch.float64) for _ in s.entries]


def test_ranks_that_agree_get_the_summed_residuals():
    s = make_state()
    z_i, z, flags, theta_sq = round_inputs(s)
    theta_sq = [torch.tensor(4.0, dtype=torch.float64) for _ in s.entries]
    totals, s_top = verdict_of(s)(z_i, z, flags, 3, theta_sq)
    assert totals.shape == (len(s.entries), 3) and bool((totals[:, 0] == 4.0).all()) and s_top == [0.0] * len(s.entries)


@pytest.mark.parametrize("case, error, said", [
    (dict(other_steps=4), RuntimeError, r"different numbers of optimizer steps \(3 on rank 0; 4 on rank 1\)"),
    (dict(other_round=7), RuntimeError, r"different rounds \(1 on rank 0; 7 on rank 1\)"),
    (dict(other_bad=True), FloatingPointError, r"inf or NaN in 0\.weight, from θ \+ u of rank 1"),
])
def test_a_round_that_cannot_be_trusted_is_refused_naming_the_ranks(case, error, said):
    s = make_state()
    with pytest.raises(error, match=said):
        verdict_of(s, **case)(*round_inputs(s)[:3], 3, round_inputs(s)[3])


def test_an_overflowing_consensus_is_refused_though_every_rank_was_finite():
    s = make_state()
    z_i, z, flags, theta_sq = round_inputs(s)
    z = [t.clone() for t in z]
    z[0][0] = float("inf")   # the consensus itself overflowed
    with pytest.raises(FloatingPointError, match=r"from the consensus \(it overflowed from finite inputs"):
        verdict_of(s)(z_i, z, flags, 3, theta_sq)


def test_nonfinite_names_the_entry_and_the_buffers_apart():
    layout = BucketLayout([3, 2, 4], torch.float32, "cpu", bucket_bytes=16)
    for v in layout.views:
        v.fill_(1.0)
    assert nonfinite(layout, 2) == [False, False, False]
    layout.views[1][0] = float("nan")
    layout.views[2][3] = float("inf")
    assert nonfinite(layout, 2) == [False, True, True]   # the last flag: any float buffer


def test_the_topology_sets_which_rank_adds_the_node_terms():
    s = make_state(topo=topology(num_nodes=2, local_size=2, rank=1))   # not a leader: no node-level terms
    z_i, z, flags, theta_sq = round_inputs(s)
    z_i = [t + 1 for t in z_i]
    totals, _ = verdict_of(s)(z_i, z, flags, 3, theta_sq)
    assert bool((totals[:, 1:] == 0).all())
