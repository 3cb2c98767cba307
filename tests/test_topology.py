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
