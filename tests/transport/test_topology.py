"""The node grouping is a pure function of what every rank reported: tested here without launching."""
import pytest

from prunex_hvd.dist.topology import TopologyError, group_nodes, parse_ranks_per_node


def topo(rank, keys, override=None, grouping="test"):
    return group_nodes(rank, [(k, override) for k in keys], launcher="test", grouping=grouping)


def test_two_nodes_by_key():
    t = [topo(r, ["a", "a", "b", "b"]) for r in range(4)]
    assert [(x.node, x.local_rank, x.is_leader) for x in t] == [(0, 0, True), (0, 1, False), (1, 0, True),
                                                                (1, 1, False)]
    assert t[0].leaders == (0, 2) and t[3].local_ranks == (2, 3) and t[0].num_nodes == 2
    assert t[1].local_size == 2 and t[1].size == 4 and t[1].node_of(3) == 1


def test_round_robin_mapping_keeps_node_membership():
    # mpirun --map-by node puts ranks 0,2 on host A and 1,3 on host B
    t = [topo(r, ["A", "B", "A", "B"]) for r in range(4)]
    assert t[0].node_ranks == ((0, 2), (1, 3))
    assert [(x.node, x.local_rank) for x in t] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert t[0].leaders == (0, 1)


def test_override_ignores_keys():
    t = topo(5, ["same"] * 8, override=2)
    assert (t.node, t.local_rank, t.num_nodes, t.grouping) == (2, 1, 4, "override")


def test_heterogeneous_nodes_rejected_naming_nodes():
    with pytest.raises(TopologyError, match=r"node 0: 3 ranks \(0,1,2\); node 1: 1 rank \(3\)"):
        topo(0, ["a", "a", "a", "b"])


def test_inconsistent_override_rejected():
    reports = [("h", 2), ("h", 2), ("h", None), ("h", 2)]
    with pytest.raises(TopologyError, match=r"2 on ranks 0,1,3; unset on ranks 2"):
        group_nodes(0, reports, "test", "test")


def test_override_must_divide_world():
    with pytest.raises(TopologyError, match="does not divide the world size 6"):
        topo(0, ["h"] * 6, override=4)


@pytest.mark.parametrize("value,expected", [(None, None), ("", None), ("0", None), ("3", 3), (2, 2)])
def test_parse_ranks_per_node(value, expected):
    assert parse_ranks_per_node(value) == expected


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", -2])
def test_parse_ranks_per_node_rejects(value):
    with pytest.raises(TopologyError, match="positive integer"):
        parse_ranks_per_node(value)


def test_as_dict_has_every_field():
    d = topo(2, ["a", "a", "b", "b"]).as_dict()
    assert {k: d[k] for k in ("rank", "size", "local_rank", "local_size", "node", "num_nodes", "is_leader")} == \
        {"rank": 2, "size": 4, "local_rank": 0, "local_size": 2, "node": 1, "num_nodes": 2, "is_leader": True}


def racked(rank, keys, rpn=None, npr=None, rack_keys=None):
    rack_keys = rack_keys or [None] * len(keys)
    return group_nodes(rank, [(k, rpn, npr, rk) for k, rk in zip(keys, rack_keys)], launcher="test", grouping="t")


def test_racks_by_override_group_consecutive_nodes():
    t = [racked(r, ["h"] * 8, rpn=2, npr=2) for r in range(8)]   # 2 racks × 2 nodes × 2 ranks
    assert t[0].racks == ((0, 1), (2, 3)) and t[0].num_racks == 2 and t[0].nodes_per_rack == 2
    assert [x.rack for x in t] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert t[0].rack_leaders == (0, 4) and [x.is_rack_leader for x in t] == [True] + [False] * 3 + [True] + [False] * 3
    assert t[2].rack_node_leaders == (0, 2) and t[6].rack_node_leaders == (4, 6)
    assert t[5].as_dict()["rack_nodes"] == [[0, 1], [2, 3]] and t[5].as_dict()["rack"] == 1
    assert "rack 1/2" in str(t[5])


@pytest.mark.parametrize("npr", [None, 1])
def test_without_racks_every_node_is_its_own_rack(npr):
    t = racked(2, ["a", "a", "b", "b"], npr=npr)
    assert t.rack_nodes == () and t.racks == ((0,), (1,)) and t.rack == 1 and t.nodes_per_rack == 1
    assert t.rack_leaders == t.leaders and t.rack_node_leaders == (2,) and "rack" not in str(t)


def test_one_rack_of_every_node():
    t = racked(3, ["h"] * 4, rpn=1, npr=4)
    assert t.racks == ((0, 1, 2, 3),) and t.rack_leaders == (0,) and t.rack_node_leaders == (0, 1, 2, 3)


def test_racks_from_slurm_switches_follow_the_hosts():
    # hosts a, b under leaf switch s1, hosts c, d under s2, ranks placed round robin over the hosts
    keys, switches = ["a", "c", "b", "d"] * 2, ["s0.s1", "s0.s2", "s0.s1", "s0.s2"] * 2
    t = racked(1, keys, rack_keys=switches)
    assert t.node_ranks == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert t.racks == ((0, 2), (1, 3)) and t.rack == 1 and t.rack_leaders == (0, 1)


def test_unequal_racks_are_refused_naming_them():
    with pytest.raises(TopologyError, match=r"rack 0: 2 nodes \(0,1\); rack 1: 1 node \(2\)"):
        racked(0, ["a", "b", "c"], rack_keys=["s1", "s1", "s2"])
    with pytest.raises(TopologyError, match="nodes_per_rack=2 does not divide the 3 nodes"):
        racked(0, ["a", "b", "c"], npr=2)


def test_disagreeing_rack_reports_are_refused():
    with pytest.raises(TopologyError, match=r"ranks disagree about nodes_per_rack .*2 on ranks 0,1,2; unset on ranks 3"):
        group_nodes(0, [("h", 1, 2, None)] * 3 + [("h", 1, None, None)], "test", "test")
    with pytest.raises(TopologyError, match=r"the ranks of node 0 \(0,1\) report different racks"):
        racked(0, ["a", "a", "b", "b"], rack_keys=["s1", "s2", "s3", "s3"])


@pytest.mark.parametrize("addr, key", [("spine.leaf3.node12", "spine.leaf3"), ("leaf.node", "leaf"), ("node", None),
                                       ("", None), ("a..b", None)])
def test_slurm_rack_key(addr, key):
    from prunex_hvd.dist.topology import slurm_rack_key
    assert slurm_rack_key({"SLURM_TOPOLOGY_ADDR": addr}) == key


def test_parse_nodes_per_rack():
    from prunex_hvd.dist.topology import parse_nodes_per_rack
    assert parse_nodes_per_rack("4") == 4 and parse_nodes_per_rack("0") is None
    with pytest.raises(TopologyError, match="nodes_per_rack must be a positive integer"):
        parse_nodes_per_rack("x")
