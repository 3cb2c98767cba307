"""prunex_hvd.elastic in one process: what a commit keeps and a restore brings back (no communication), the
fail-fast path outside horovodrun's elastic mode, and the refusals. A node lost and joined for real:
tests/launch/test_elastic_launch.py; the math of it: tests/engine/test_elastic_threads.py."""
import copy
import os

import pytest
import torch

import prunex_hvd as px
from models_for_tests import toy_cnn, toy_train as train

pytestmark = pytest.mark.usefixtures("single_process")   # conftest.py


def make(**kw):
    model = toy_cnn(0)
    kw.setdefault("local_steps", 3)
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                  sparsity="channel:0.5", **kw)
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


def test_the_nodes_that_go_on_are_those_whose_every_rank_holds_the_newest_round():
    from prunex_hvd.elastic import nodes_going_on
    assert nodes_going_on([(0, 7), (0, 7), (1, 7), (1, 7)]) == {0, 1}
    assert nodes_going_on([(0, 7), (0, 7), (1, None), (1, None)]) == {0}                # node 1 joins
    assert nodes_going_on([(0, 9), (0, 9), (1, 4), (1, 4)]) == {0}                      # node 1 cut off, behind
    assert nodes_going_on([(0, 9), (0, 9), (1, 9), (1, None), (2, 9)]) == {0, 2}         # a node joins whole
    assert nodes_going_on([(0, None), (1, None)]) == set()                              # a fresh job
    with pytest.raises(ValueError, match="no node has every rank's state at one round"):
        nodes_going_on([(0, 3), (0, None), (1, 2), (1, 3)])


@pytest.fixture
def node_commits(tmp_path, monkeypatch):
    """A NodeCommits in tmp_path, as torchrun's worker of local rank 1 in run 'job/1' would make it."""
    from prunex_hvd.dist.node_commits import NodeCommits

    def make_commits():
        with monkeypatch.context() as env:   # (only while it is made: the rest of the test is no torchrun launch)
            env.setenv("TORCHELASTIC_RUN_ID", "job/1")
            env.setenv("LOCAL_RANK", "1")
            return NodeCommits(root=str(tmp_path))
    return make_commits


def test_node_commits_keep_the_last_two_rounds_and_forget_agents_that_are_gone(tmp_path, node_commits):
    import subprocess
    import sys
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f"prunex_hvd-commits-job_1-{gone}").mkdir()          # an agent that ended: removed
    (tmp_path / "prunex_hvd-commits-job_1-1").mkdir()                # pid 1 lives: kept
    (tmp_path / f"prunex_hvd-commits-other-{gone}").mkdir()          # another run's: not ours to remove
    commits = node_commits()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prunex_hvd-commits-job_1-1",
                                                          f"prunex_hvd-commits-other-{gone}"]
    assert commits.read() == (None, None)
    for round_, value in [(1, "a"), (2, "b"), (2, "b2"), (3, "c")]:
        commits.write(round_, {"value": value})
    assert commits.read() == ({"value": "c"}, {"value": "b2"})
    assert sorted(os.listdir(commits.dir)) == ["rank1.round2.pt", "rank1.round3.pt"]
    assert node_commits().read() == ({"value": "c"}, {"value": "b2"})   # the next worker of the same agent
    commits.clear()
    assert not os.path.exists(commits.dir)


def test_a_commit_that_cannot_be_written_says_how_to_make_room(node_commits, monkeypatch):
    import errno
    commits = node_commits()
    commits.write(1, {"value": 1})

    def full(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(RuntimeError, match=r"could not be written .*No space left.*docker run --shm-size"):
        commits.write(2, {"value": 2})
    monkeypatch.undo()
    assert commits.read() == ({"value": 1}, None)   # the commit before stands


def test_a_restarted_worker_takes_up_its_node_commit_bit_for_bit(node_commits, monkeypatch):
    """torchrun: what one worker commits, the next worker of its agent (a new process: a new model, optimizer and
    State) takes up whole, the job's settings included. The launch must not share torch's rendezvous store."""
    from prunex_hvd.dist import watchdog
    monkeypatch.setattr(watchdog, "_way_back", watchdog._way_back)
    model, opt = make()
    state = px.elastic.State(model, opt, batch=0)
    state._node_commits = node_commits()

    class Stopped(Exception):
        pass

    @px.elastic.run
    def loop(state):
        train(model, opt, 6)
        state.batch = 6
        state.commit()
        raise Stopped   # as torchrun's agent stops a worker: before the job's end, which clears the commits
    with pytest.raises(ValueError, match="elastic under torchrun needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        loop(state)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    with pytest.raises(Stopped):
        loop(state)
    assert sorted(os.listdir(state._node_commits.dir)) == ["rank1.round0.pt", "rank1.round2.pt"]
    model2, opt2 = make(local_steps=5)   # this worker resolved another round length
    state2 = px.elastic.State(model2, opt2, batch=0)
    state2._node_commits = node_commits()
    state2.reload()
    assert state2.batch == 6 and opt2.rounds_done() == 2 and opt2.local_steps == 3
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in model.state_dict().items())
    a, b = opt.state_dict(), opt2.state_dict()
    for name, entry in a["prunex"]["entries"].items():
        for key in ("u", "z_i", "v", "z"):
            assert torch.equal(b["prunex"]["entries"][name][key], entry[key]), (name, key)
    train(model, opt, 3)
    train(model2, opt2, 3)
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in model.state_dict().items())
    px.elastic.run(lambda state: None)(state2)   # a job that ends clears its commits
    assert not os.path.exists(state2._node_commits.dir)
