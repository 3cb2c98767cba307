"""The ring traffic model and the ledger, checked against sums written out by hand."""
import pytest

from prunex_hvd.dist.comm.accounting import CommLedger, CommRecord, ring_cross_node_bytes, ring_sent_bytes


def test_allreduce_ring_sends_2_n_minus_1_over_n():
    assert [ring_sent_bytes("allreduce", [1000] * 4, k) for k in range(4)] == [1500] * 4
    assert ring_sent_bytes("allreduce", [1000] * 2, 0) == 1000  # two members: each sends B
    assert ring_sent_bytes("allreduce", [1000], 0) == 0


def test_allgather_forwards_all_but_successor_block():
    sizes = [10, 20, 30, 40]
    assert [ring_sent_bytes("allgather", sizes, k) for k in range(4)] == [80, 70, 60, 90]
    # every block reaches the n-1 others exactly once in total
    assert sum(ring_sent_bytes("allgather", sizes, k) for k in range(4)) == 3 * sum(sizes)


def test_broadcast_chain_from_root():
    assert [ring_sent_bytes("broadcast", [8] * 4, k, root=2) for k in range(4)] == [8, 0, 8, 8]
    assert sum(ring_sent_bytes("broadcast", [8] * 5, k, root=0) for k in range(5)) == 4 * 8


def test_cross_node_only_on_links_leaving_the_node():
    nodes = [0, 0, 1, 1]
    cross = [ring_cross_node_bytes("allreduce", [400] * 4, k, nodes) for k in range(4)]
    assert cross == [0, 600, 0, 600]
    assert ring_cross_node_bytes("allreduce", [400] * 2, 0, [0, 0]) == 0          # intra group
    assert ring_cross_node_bytes("allreduce", [400] * 2, 1, [0, 1]) == 400        # leaders


def test_unknown_op_refused():
    with pytest.raises(ValueError, match="no traffic model"):
        ring_sent_bytes("alltoall", [1, 1], 0)


def test_ledger_summary_and_reset():
    led = CommLedger(keep_records=True)
    led.add(CommRecord("allreduce", "inter", "mpi", 100, 100, 100, 0.5))
    led.add(CommRecord("allreduce", "inter", "mpi", 50, 50, 50, 0.25))
    led.add(CommRecord("broadcast", "intra", "mpi", 10, 10, 0, 0.1))
    s = led.summary(by_op=True)
    assert s["inter"]["ops"] == 2 and s["inter"]["payload_bytes"] == 150 and s["inter"]["seconds"] == 0.75
    assert s["intra"]["cross_node_bytes"] == 0 and s["world"]["ops"] == 0
    assert s["total"]["payload_bytes"] == 160 and s["total"]["cross_node_bytes"] == 150
    assert s["inter"]["by_op"]["allreduce"]["ops"] == 2 and len(led.records) == 3
    led.reset()
    assert led.summary()["total"]["ops"] == 0 and led.records == []


def test_tagged_traffic_is_kept_apart():
    led = CommLedger()
    with led.tagged("consensus"):
        led.add(CommRecord("allreduce", "inter", "mpi", 64, 64, 64, 0.0, tag=led.current_tag))
    led.add(CommRecord("allreduce", "inter", "mpi", 8, 8, 8, 0.0, tag=led.current_tag))
    by_op = led.summary(by_op=True)["inter"]["by_op"]
    assert by_op["allreduce[consensus]"]["payload_bytes"] == 64 and by_op["allreduce"]["payload_bytes"] == 8
    assert led.current_tag == ""
