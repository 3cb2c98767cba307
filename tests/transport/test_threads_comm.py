"""The thread-backed communicator (prunex_hvd.dist.comm.threads): every collective on M×P ranks in one process,
its byte accounting against the ring model, and a failing rank that stops the others at once."""
import time

import pytest
import torch

from prunex_hvd.dist.comm.accounting import ring_cross_node_bytes, ring_sent_bytes
from prunex_hvd.dist.comm.threads import ClusterAborted, thread_cluster
from threaded import RankFailed, run_ranks


def test_groups_follow_the_layout():
    cluster = thread_cluster(2, 3)
    assert len(cluster) == 6
    for rank in cluster:
        topo, groups, ledger = rank
        assert (topo.node, topo.local_rank, topo.num_nodes, topo.local_size) == (rank.topo.rank // 3,
                                                                                rank.topo.rank % 3, 2, 3)
        assert groups.intra.ranks == topo.local_ranks and groups.intra.rank == topo.local_rank
        assert groups.world.ranks == tuple(range(6)) and groups.world.nodes == (0, 0, 0, 1, 1, 1)
        assert (groups.inter is not None) == topo.is_leader
        assert ledger is not cluster[(topo.rank + 1) % 6].ledger   # a ledger of its own
    assert cluster[3].groups.inter.ranks == (0, 3) and cluster[3].groups.inter.rank == 1


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_allreduce_is_bit_identical_on_every_rank(op):
    values = [torch.randn(1000, dtype=torch.float32, generator=torch.Generator().manual_seed(r)) for r in range(5)]
    want = {"sum": sum(values[1:], values[0].clone()), "max": torch.stack(values).max(0).values,
            "avg": sum(values[1:], values[0].clone()) / 5}[op]

    def work(rank):
        t = values[rank.topo.rank].clone()
        assert rank.groups.world.allreduce_(t, op) is t
        return t
    results = run_ranks(1, 5, work)
    for t in results:
        assert torch.equal(t, results[0])
    torch.testing.assert_close(results[0], want)


def test_bor_of_uint8_masks_on_the_leaders():
    masks = [torch.tensor([1, 0, 0, 4], dtype=torch.uint8), torch.tensor([0, 2, 0, 4], dtype=torch.uint8),
             torch.tensor([0, 0, 0, 8], dtype=torch.uint8)]

    def work(rank):
        if rank.groups.inter is None:
            return None
        return rank.groups.inter.bor_(masks[rank.topo.node].clone()).tolist()
    results = run_ranks(3, 2, work)
    assert results == [[1, 2, 0, 12], None] * 3


def test_broadcast_from_a_nonzero_root():
    def work(rank):
        t = torch.full((2, 3), float(rank.topo.rank))
        rank.groups.intra.broadcast_(t, root=2)
        return t
    results = run_ranks(2, 3, work)
    assert [float(t[0, 0]) for t in results] == [2.0] * 3 + [5.0] * 3


def test_allgather_equal_and_unequal():
    def work(rank):
        r = rank.topo.rank
        equal = rank.groups.world.allgather(torch.tensor([r, 10 * r]), same_shape=True)
        unequal = rank.groups.world.allgather(torch.arange(r + 1, dtype=torch.float64).reshape(-1, 1) + r)
        unequal[0].add_(100)   # every rank's outputs are its own
        return equal, unequal
    results = run_ranks(2, 2, work)
    for equal, unequal in results:
        assert [t.tolist() for t in equal] == [[r, 10 * r] for r in range(4)]
        assert [t.shape for t in unequal] == [(r + 1, 1) for r in range(4)]
        assert unequal[0].item() == 100 and [t[-1, 0].item() for t in unequal[1:]] == [2.0, 4.0, 6.0]


def test_accounting_follows_the_ring_model():
    """Each rank's ledger holds what the ring model says it sent, per group: all of a leader's inter traffic
    crosses nodes, none of the intra traffic, and on the world ring only the links leaving a node."""
    cluster = thread_cluster(3, 2, keep_records=True)
    sizes = {"world": [400] * 6, "intra": [400] * 2, "inter": [400] * 3}

    def work(rank):
        g = rank.groups
        g.world.allreduce_(torch.zeros(100))
        g.intra.broadcast_(torch.zeros(100), root=1)
        if g.inter is not None:
            g.inter.allreduce_(torch.zeros(100), "avg")
        gathered = g.world.allgather(torch.zeros(rank.topo.rank + 1, dtype=torch.float64))
        return [t.numel() for t in gathered]
    assert run_ranks(3, 2, work, cluster=cluster) == [[1, 2, 3, 4, 5, 6]] * 6
    for rank in cluster:
        by_op = {(rec.tier, rec.op): rec for rec in rank.ledger.records}
        for tier, op, comm in (("world", "allreduce", rank.groups.world), ("intra", "broadcast", rank.groups.intra),
                               ("inter", "allreduce", rank.groups.inter)):
            if comm is None:
                assert (tier, op) not in by_op
                continue
            rec, root = by_op[(tier, op)], 1 if op == "broadcast" else 0
            assert rec.payload_bytes == 400 and rec.backend == "threads"
            assert rec.wire_bytes == ring_sent_bytes(op, sizes[tier], comm.rank, root)
            assert rec.cross_node_bytes == ring_cross_node_bytes(op, sizes[tier], comm.rank, comm.nodes, root)
        gather = by_op[("world", "allgather")]
        blocks = [8 * (r + 1) for r in range(6)]
        assert gather.payload_bytes == blocks[rank.topo.rank]   # not padded: the thread backend sends each as is
        assert gather.wire_bytes == ring_sent_bytes("allgather", blocks, rank.topo.rank)
        assert ("world", "allgather_sizes") in by_op
    leader, other = cluster[2].ledger.summary(), cluster[3].ledger.summary()
    assert leader["inter"]["cross_node_bytes"] == 2 * 2 * 400 // 3 and leader["intra"]["cross_node_bytes"] == 0
    assert other["inter"]["ops"] == 0 and other["world"]["cross_node_bytes"] > 0   # rank 3 -> 4 leaves node 1


def test_a_failing_rank_stops_the_others_at_once():
    """Rank 2 raises before its collective; the others, already waiting in theirs, are released by the abort
    within a moment (not the 60 s barrier timeout), and the error names rank 2."""
    def work(rank):
        if rank.topo.rank == 2:
            time.sleep(0.2)
            raise KeyError("boom")
        rank.groups.world.allreduce_(torch.ones(4))
        rank.groups.world.barrier()
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="rank 2 failed: KeyError") as info:
        run_ranks(2, 2, work, timeout=60)
    assert time.monotonic() - t0 < 10
    assert info.value.rank == 2 and isinstance(info.value.__cause__, KeyError)


def test_a_collective_that_waits_too_long_aborts_the_cluster():
    cluster = thread_cluster(1, 2, timeout=0.5)

    def work(rank):
        if rank.topo.rank == 0:
            rank.groups.intra.barrier()   # rank 1 never comes
        else:
            time.sleep(0.8)
            rank.groups.intra.barrier()   # the broken barrier refuses it at once
    with pytest.raises(RankFailed, match="waited more than 0.5 s"):
        run_ranks(1, 2, work, cluster=cluster)
    assert cluster.aborted


def test_different_collectives_on_one_group_raise_on_every_rank():
    def work(rank):
        t = torch.ones(3)
        with pytest.raises(RuntimeError, match="called different collectives"):
            if rank.topo.rank == 0:
                rank.groups.world.allreduce_(t)
            else:
                rank.groups.world.broadcast_(t)
        with pytest.raises(ValueError, match="members sent different tensors"):
            rank.groups.world.allreduce_(torch.ones(rank.topo.rank + 1))
        return rank.groups.world.allreduce_(t).tolist()   # the group still works
    assert run_ranks(1, 2, work) == [[2.0] * 3] * 2


def test_a_rank_still_running_is_named():
    def work(rank):
        if rank.topo.rank == 1:
            time.sleep(1.0)
    with pytest.raises(TimeoutError, match=r"ranks \[1\]"):
        run_ranks(1, 2, work, timeout=0.5)


def test_an_async_allreduce_runs_while_the_node_groups_talk():
    """allreduce_async_ on the leaders' group: the node groups run blocking collectives meanwhile (what the
    overlapped round's local steps do with node_sync), the result is the blocking allreduce's, and it is
    accounted once, when waited on, with the time wait() blocked."""
    values = [torch.randn(300, generator=torch.Generator().manual_seed(r)) for r in range(4)]

    def work(rank):
        topo, groups, ledger = rank
        t = values[topo.rank].clone()
        work = groups.inter.allreduce_async_(t, "avg") if topo.is_leader else None
        side = torch.full((5,), float(topo.rank))
        for _ in range(3):
            groups.intra.allreduce_(side, "sum")
        if work is not None:
            work.wait()
            work.wait()   # once only
        records = [r for r in ledger.records if r.tier == "inter"]
        return t, side, records, work
    results = run_ranks(2, 2, work, cluster=thread_cluster(2, 2, keep_records=True))
    want = (values[0] + values[2]) / 2
    for r, (t, side, records, work) in enumerate(results):
        if r in (0, 2):
            torch.testing.assert_close(t, want)
            assert len(records) == 1 and records[0].payload_bytes == 300 * 4 and records[0].op == "allreduce"
            assert work.completed and records[0].seconds == pytest.approx(work.wait_seconds, abs=0.05)
        else:
            assert torch.equal(t, values[r]) and not records
    for r, (_, side, _, _) in enumerate(results):   # three sums over the node: 4^2·(the node's sum)
        node_sum = float(sum(q for q in range(4) if q // 2 == r // 2))
        assert torch.equal(side, torch.full((5,), node_sum * 4))


def test_a_failing_leader_fails_the_others_async_wait():
    """A leader that never starts its half of an async allreduce (it failed): the other's wait() raises once
    the cluster is aborted, instead of hanging."""
    def work(rank):
        topo, groups, _ = rank
        if topo.rank == 2:
            raise ValueError("boom")
        if topo.is_leader:
            groups.inter.allreduce_async_(torch.ones(3), "sum").wait()
    with pytest.raises(RankFailed, match="rank 2"):
        run_ranks(2, 2, work, timeout=30)


def test_rack_groups_and_bytes_that_cross_racks():
    """2 racks × 2 nodes × 2 ranks: ``rack`` holds the node leaders of a rack, ``spine`` the rack leaders; each
    group sums exactly its members, and the ledger's cross_rack_bytes counts only ring hops between racks."""
    cluster = thread_cluster(4, 2, keep_records=True, nodes_per_rack=2)
    nbytes = 4 * 1000

    def body(rank):
        g = rank.groups
        layout = (g.rack is not None and g.rack.ranks, g.spine is not None and g.spine.ranks)
        for comm in (g.rack, g.spine, g.world):
            if comm is not None:
                t = torch.full((1000,), float(rank.topo.rank))
                comm.allreduce_(t, "sum")
                assert t.eq(float(sum(comm.ranks))).all()
        return layout, {r.tier: (r.cross_node_bytes, r.cross_rack_bytes) for r in rank.ledger.records}
    results = run_ranks(4, 2, body, cluster=cluster)
    assert [layout for layout, _ in results] == [((0, 2), (0, 4)), (False, False), ((0, 2), False), (False, False),
                                                 ((4, 6), (0, 4)), (False, False), ((4, 6), False), (False, False)]
    for r, (_, tiers) in enumerate(results):
        if r in (0, 2, 4, 6):   # a rack of two node leaders: every hop crosses nodes, none crosses racks
            assert tiers["rack"] == (nbytes, 0)
        if r in (0, 4):         # the spine: every hop crosses racks
            assert tiers["spine"] == (nbytes, nbytes)
        # the world ring 0→1→…→7→0 leaves a node at odd ranks and a rack at ranks 3 and 7
        ring = ring_sent_bytes("allreduce", [nbytes] * 8, r)
        assert tiers["world"] == (ring if r % 2 else 0, ring if r in (3, 7) else 0)
    summary = cluster[0].ledger.summary()
    assert summary["spine"]["cross_rack_bytes"] == nbytes and summary["rack"]["cross_rack_bytes"] == 0
    assert summary["total"]["cross_rack_bytes"] == nbytes


def test_without_racks_there_are_no_rack_groups_and_racks_are_nodes():
    cluster = thread_cluster(2, 2, keep_records=True)

    def body(rank):
        g = rank.groups
        t = torch.ones(10)
        g.world.allreduce_(t)
        rec = rank.ledger.records[-1]
        return g.rack, g.spine, rec.cross_node_bytes == rec.cross_rack_bytes
    assert run_ranks(2, 2, body, cluster=cluster) == [(None, None, True)] * 4


def test_the_auto_backend_keeps_the_rack_groups_and_every_members_rack():
    """``backend="auto"`` (the default under MPI) wraps each group: the rack and spine groups and the members'
    racks must come through, or the rack tier finds no groups and the ledger counts every node hop as a rack's."""
    from prunex_hvd.dist.comm.auto import AutoCommunicator, combine

    for rank in thread_cluster(4, 2, nodes_per_rack=2):
        plain, auto = rank.groups, combine(rank.groups, None)
        for tier in ("world", "intra", "inter", "rack", "spine"):
            a, b = getattr(plain, tier), getattr(auto, tier)
            assert (a is None) == (b is None), tier
            if b is not None:
                assert isinstance(b, AutoCommunicator) and b.cpu is a and (b.ranks, b.racks) == (a.ranks, a.racks)
        assert auto.world.racks == (0, 0, 0, 0, 1, 1, 1, 1)
