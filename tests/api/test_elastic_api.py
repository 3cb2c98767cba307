"""prunex_hvd.elastic in one process: what a commit keeps and a restore brings back (no communication), the
fail-fast path outside horovodrun's elastic mode, and the refusals. A node lost and joined for real:
tests/launch/test_elastic_launch.py; the math of it: tests/engine/test_elastic_threads.py."""
import copy

import pytest
import torch

import prunex_hvd as px
from models_for_tests import toy_cnn, toy_train as train

pytestmark = pytest.mark.usefixtures("single_process")   # conftest.py


def make(**kw):
    model = toy_cnn(0)
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                  sparsity="channel:0.5", local_steps=3, **kw)
    return model, opt


def test_a_restore_brings_back_the_last_commit_bit_for_bit():
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = px.elastic.State(model, opt, epoch=3, sched=sched)
    seen = []

    @px.elastic.run
    def loop(state):
        train(model, opt, 6)
        sched.step()
        state.epoch = 4
        state.commit()
        kept = ({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict()),
                opt.rounds_done(), sched.state_dict())
        train(model, opt, 4)   # a round and a step past the commit
        sched.step()
        state.epoch = 5
        assert opt.rounds_done() == kept[2] + 1
        state.restore()
        seen.append(kept)
        return state.epoch
    assert loop(state) == 4
    params, opt_sd, rounds, sched_sd = seen[0]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in params.items())
    assert opt.rounds_done() == rounds and opt.stats()["steps"] == 6 and sched.state_dict() == sched_sd
    now = opt.state_dict()
    for name, entry in opt_sd["prunex"]["entries"].items():
        for key in ("u", "z_i", "v", "z"):
            assert torch.equal(now["prunex"]["entries"][name][key], entry[key]), (name, key)
    momentum = [s["momentum_buffer"] for s in opt_sd["state"].values()]
    assert all(torch.equal(a["momentum_buffer"], b) for a, b in zip(now["state"].values(), momentum))
    train(model, opt, 3)   # and trains on from there
    assert opt.rounds_done() == rounds + 1


def test_outside_an_elastic_launch_it_runs_once_and_refuses_too_few_nodes():
    model, opt = make()
    calls = []

    @px.elastic.run
    def loop(state):
        calls.append(px.topology().num_nodes)
        train(model, opt, 3)
        return opt.rounds_done()
    assert loop(px.elastic.State(model, opt)) == 1 and calls == [1]
    with pytest.raises(ValueError, match=r"1 node\(s\) left \(1 rank\(s\)\), fewer than min_nodes=2"):
        loop(px.elastic.State(model, opt, min_nodes=2))
    with pytest.raises(ValueError, match="min_nodes must be an integer >= 1"):
        px.elastic.State(model, opt, min_nodes=0)
    with pytest.raises(ValueError, match="takes the optimizer prunex_hvd.DistributedOptimizer returned"):
        px.elastic.State(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="the first argument must be a prunex_hvd.elastic.State"):
        loop(object())


def test_under_an_elastic_launch_nothing_talks_before_the_state_forms_the_nodes(monkeypatch):
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    with pytest.raises(RuntimeError, match="formed inside a function decorated with @prunex_hvd.elastic.run"):
        px.init()
    model, opt = make()   # no collective: the engine waits for the State's sync
    assert not px.is_initialized()
    with pytest.raises(RuntimeError, match="trains inside a function decorated with @prunex_hvd.elastic.run"):
        opt.rounds_done()
    with pytest.raises(ValueError, match="overlap=True under elastic training"):
        make(overlap=True)
    with pytest.raises(ValueError, match="backend='horovod' under elastic training"):
        make(backend="horovod")


def test_a_rank_a_round_ahead_goes_back_to_its_commit_before():
    """What sync() does when a failure struck between two ranks' commits of one round: the rank ahead restores
    the commit before its last."""
    model, opt = make()
    state = px.elastic.State(model, opt, batch=0)

    @px.elastic.run
    def loop(state):
        train(model, opt, 3)
        state.batch = 3
        state.commit()
        first = {k: v.clone() for k, v in model.state_dict().items()}
        train(model, opt, 3)
        state.batch = 6
        state.commit()
        state.restore(previous=True)
        return first
    first = loop(state)
    assert opt.rounds_done() == 1 and state.batch == 3
    assert all(torch.equal(model.state_dict()[k], v) for k, v in first.items())


def test_a_rank_that_cannot_reach_the_launcher_leaves_saying_its_host_is_cut_off(monkeypatch):
    import socket
    from prunex_hvd import elastic
    with socket.socket() as server:   # the launcher's rendezvous answering: no wait
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")
        monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", str(server.getsockname()[1]))
        elastic._reach_launcher(5.0)
    # no one listens there now: the host is cut off once the timeout has passed
    monkeypatch.setenv("HOROVOD_HOSTNAME", "hostB")
    with pytest.raises(RuntimeError, match=r"host hostB cannot reach the launcher's rendezvous at 127\.0\.0\.1:\d+ "
                                           r"for 1 s .*the others go on without it"):
        elastic._reach_launcher(1.0)


def test_hosts_added_before_any_change_are_heard():
    """Horovod's notification of an added host reaches a job that has not changed yet: a job started small grows
    at its next commit."""
    worker = pytest.importorskip("horovod.runner.elastic.worker")
    from horovod.common.exceptions import HostsUpdatedInterrupt
    model, opt = make()
    state = px.elastic.State(model, opt)

    @px.elastic.run
    def loop(state):
        state.on_hosts_updated(1.0, worker.HostUpdateResult.added)
        with pytest.raises(HostsUpdatedInterrupt):
            state.check_host_updates()
        state.check_host_updates()   # heard once
    loop(state)
