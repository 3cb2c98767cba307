"""The watchdog's pieces in one process: the timeout knob, and the hub telling a death (a connection closed without
a goodbye) from a clean exit and a rank behind the others. The real thing, under launchers: test_faults.py."""
import json
import socket
import time

import pytest

from prunex_hvd.dist import watchdog


@pytest.mark.parametrize("value,env,want", [(None, None, 600.0), (None, "12.5", 12.5), (3, "12.5", 3.0),
                                            ("0", None, 0.0)])
def test_timeout_knob(monkeypatch, value, env, want):
    if env is None:
        monkeypatch.delenv(watchdog.ENV_TIMEOUT, raising=False)
    else:
        monkeypatch.setenv(watchdog.ENV_TIMEOUT, env)
    assert watchdog.timeout_s(value) == want


@pytest.mark.parametrize("bad", ["-1", "abc", "nan", float("inf")])
def test_bad_timeout_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"PRUNEX_TIMEOUT_S / --timeout\) must be a number of seconds >= 0"):
        watchdog.timeout_s(bad)


def raw_rank(port, rank, arrived):
    """A peer speaking the protocol by hand: one heartbeat, answer read."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall((json.dumps({"op": "hb", "rank": rank, "arrived": arrived, "where": f"step {arrived}", "seq": 1})
               + "\n").encode())
    assert json.loads(s.makefile().readline())["seq"] == 1
    return s


def wait_for(cond, what):
    end = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.02)


def test_hub_tells_death_from_goodbye_and_names_the_missing():
    hub = watchdog._Hub(4)
    wd = watchdog.Watchdog(0, 4, 5.0, ("127.0.0.1", hub.port), hub)
    try:   # where this rank is, set by hand: entering a section would arm it, and it would end pytest
        wd.arrived, wd.where = 3, "consensus round 3"
        r1 = raw_rank(hub.port, 1, 3)           # arrived, then dies (no goodbye)
        r2 = raw_rank(hub.port, 2, 2)           # one world step behind
        r3 = raw_rank(hub.port, 3, 3)           # leaves cleanly
        r3.sendall(b'{"op": "bye", "rank": 3, "arrived": 3, "where": "step 3"}\n')
        r3.close()
        r1.close()
        wait_for(lambda: hub.table[1]["status"] == "dead" and hub.table[3]["status"] == "exited", "hub saw both")
        reply = wd._ask("hb")
        assert reply["dead"] == [1] and reply["stop"] is None
        said = wd._missing(wd._ask("query"))
        assert "rank 1 died (its process is gone)" in said and "rank 3 exited" in said
        assert "rank 2 has not arrived (still after 'step 2')" in said and "this rank is at 'consensus round 3'" in said
        r2.close()
    finally:
        wd._stopped.set()
        wd.sock.close()
        hub.close()
