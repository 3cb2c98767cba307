"""The consensus state's contract (:mod:`prunex_hvd.engine.state`): saved and loaded whole and bit for bit, and a
state that does not fit refused with what differs."""
import pytest
import torch

from components import chain, state as make_state, topology


def trained_state(**knobs):
    s = make_state(payload_dtype="bf16", **knobs)
    torch.manual_seed(3)
    for e in s.entries:
        for t in (e.u, e.z_i, e.v, e.z, e.sent):
            t.normal_()
        e.rho1, e.rho2, e.residuals = 0.02, 0.004, {"r_intra": 1.5}
    for ef in s.buffer_ef:
        ef.normal_()
    s.round, s.anchored_at, s.frozen, s.stable_rounds, s.mask_drift = 5, 1, True, 2, 0.25
    return s


def test_a_state_loads_bit_for_bit_into_a_fresh_one():
    saved = trained_state().state_dict()
    fresh = make_state(payload_dtype="bf16")
    fresh.load_state_dict(saved)
    again = fresh.state_dict()
    assert (again["round"], again["anchored_at"], again["frozen"], again["stable_rounds"], again["mask_drift"]) == \
        (5, 1, True, 2, 0.25)
    for name, entry in saved["entries"].items():
        for key, value in entry.items():
            other = again["entries"][name][key]
            assert torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value, (name, key)
    assert all(torch.equal(again["buffer_ef"][n], t) for n, t in saved["buffer_ef"].items())


@pytest.mark.parametrize("change, said", [
    (lambda sd: sd["entries"].pop("5.weight"), r"missing \['5\.weight'\]"),
    (lambda sd: sd["entries"]["3.weight"].update(z=torch.zeros(6, 8, 1, 1)), r"3\.weight has shape \(6, 8, 1, 1\)"),
    (lambda sd: sd["entries"]["3.weight"].update(w=torch.zeros(1), t=torch.zeros(1)), r"saved with the rack tier"),
    (lambda sd: sd.update(sync_lowrank={"rank": 4}), r"saved with sync_powersgd_rank, which this version no longer"),
])
def test_a_state_that_does_not_fit_is_refused_saying_what_differs(change, said):
    sd = trained_state().state_dict()
    change(sd)
    with pytest.raises(ValueError, match=said):
        make_state(payload_dtype="bf16").load_state_dict(sd)


def test_the_tiers_follow_the_topology_and_the_payload():
    assert not make_state(topo=topology(num_nodes=1, local_size=2), payload_dtype="bf16").delta_coded   # one node
    s = make_state(payload_dtype="bf16")
    assert s.delta_coded and s.inter_tier and not s.rack_tier
    assert all(torch.equal(e.sent, e.z) for e in s.entries) and s.anchored_at == 0   # a leader's bases start at z
    assert [e.name for e in s.structured] == ["0.weight", "3.weight"]
    assert all(bool(e.rows.all()) and bool(e.cols.all()) for e in s.structured)   # masks start all ones
    assert torch.equal(s.entries[0].z, chain()[0].weight.detach())


def test_a_state_says_whose_it_is_and_loads_only_there():
    """Each rank holds its own duals: a state saved on rank 1 of 2 nodes × 2 is refused on rank 0 (Horovod's habit
    of saving on rank 0 and loading everywhere would otherwise resume every rank with rank 0's u and z_i), and
    on a job laid out otherwise; on its own rank, or without an owner (saved before states had one), it loads."""
    saved = make_state(topo=topology(2, 2, rank=1)).state_dict()
    assert saved["owner"] == {"rank": 1, "size": 4, "node_ranks": [[0, 1], [2, 3]]}
    make_state(topo=topology(2, 2, rank=1)).check_owner(saved)
    with pytest.raises(ValueError, match=r"rank 1's, loaded on rank 0: each rank holds its own duals \(u, z_i\), so "
                                         r"save the state on every rank and load each rank's own file"):
        make_state(topo=topology(2, 2, rank=0)).check_owner(saved)
    with pytest.raises(ValueError, match=r"saved by a job of 4 ranks as nodes \[\[0, 1\], \[2, 3\]\], this job is 4 "
                                         r"ranks as nodes \[\[0\], \[1\], \[2\], \[3\]\]: resume with the same"):
        make_state(topo=topology(4, 1, rank=1)).check_owner(saved)
    legacy = {k: v for k, v in saved.items() if k != "owner"}
    make_state(topo=topology(2, 2, rank=0)).check_owner(legacy)
