"""Coupled channel pruning: which conv pairs are found, and the joint projection they get."""
import itertools
import threading

import pytest
import torch
from torch import nn

from prunex_hvd import sparsity
from prunex_hvd.engine import dependencies
from prunex_hvd.app.models import build


def test_resnet_streams():
    """One group per residual stream: its block first convs and projection shortcuts read it, the stem or the
    blocks' last convs and shortcuts write it. The last stream feeds the linear head: not coupled."""
    streams = dependencies.channel_streams(build("resnet18", 10, 3))
    assert streams[0] == (("layer1.0.conv1.weight", "layer1.1.conv1.weight", "layer2.0.conv1.weight",
                           "layer2.0.downsample.0.weight"),
                          ("conv1.weight", "layer1.0.conv2.weight", "layer1.1.conv2.weight"))
    assert [len(s.readers) for s in streams] == [4, 3, 3] and [len(s.writers) for s in streams] == [3, 3, 3]
    assert not any(n.startswith("layer4.1") for s in streams for n in s.readers + s.writers)
    streams = dependencies.channel_streams(build("resnet50", 10, 3))
    # the stem's output feeds layer1.0's conv1 and its shortcut, no add: shared all the same
    assert streams[0] == (("layer1.0.conv1.weight", "layer1.0.downsample.0.weight"), ("conv1.weight",))
    assert [len(s.readers) for s in streams] == [2, 4, 5, 7]
    pairs = dependencies.channel_couplings(build("resnet50", 10, 3))
    readers = {n for s in streams for n in s.readers}
    writers = {n for s in streams for n in s.writers}
    assert not readers & set(pairs) and not writers & set(pairs.values())   # one group per side of a conv


class Stream(nn.Module):
    """x -> stem -> s; s + b(a(s)) -> t, read by c; variants: a grouped reader, the input in the sum, a conv
    called twice."""

    def __init__(self, variant=""):
        super().__init__()
        self.variant = variant
        self.stem, self.a, self.b = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)
        self.c = nn.Conv2d(4, 4, 1, groups=2 if variant == "grouped" else 1)

    def forward(self, x):
        s = torch.relu(self.stem(x)) if self.variant != "input" else x[:, :1].expand(-1, 4, -1, -1).contiguous()
        t = self.b(torch.relu(self.a(s))) + s
        if self.variant == "twice":
            t = self.b(t) + t
        return self.c(t)


def test_stream_fallbacks():
    assert dependencies.channel_streams(Stream()) == [(("a.weight", "c.weight"), ("b.weight", "stem.weight"))]
    for variant in ("grouped", "input", "twice"):
        assert dependencies.channel_streams(Stream(variant)) == [], variant


def test_stream_masks_are_the_exact_projection_onto_the_shared_set():
    """Two readers and two writers of a 6-channel stream, nothing else constraining them: keeping the 3
    channels of largest joint norm is the Frobenius-nearest point among masks where all four share one
    channel set (every subset checked); per layer the readers would disagree."""
    g = torch.Generator().manual_seed(5)
    w = {"r1": torch.randn(3, 6, 3, 3, generator=g), "r2": torch.randn(5, 6, 1, 1, generator=g),
         "w1": torch.randn(6, 2, 3, 3, generator=g), "w2": torch.randn(6, 4, 1, 1, generator=g)}
    w["r1"][:, 0] *= 3
    w["r2"][:, 5] *= 4
    w["w1"][2] *= 3
    specs = {n: sparsity.parse_spec("channel:0.5") for n in w}
    stream = dependencies.Stream(("r1", "r2"), ("w1", "w2"))
    masks = sparsity.coupled_masks(w, specs, {}, [stream])
    kept = masks["w1"][0]
    for n in ("r1", "r2"):
        assert torch.equal(masks[n][1].view(6, -1)[:, 0], kept) and masks[n][0].all()
    assert torch.equal(masks["w2"][0], kept) and int(kept.sum()) == 3
    per_layer = [sparsity.structured_masks(w[n], specs[n])[1].view(6, -1)[:, 0] for n in ("r1", "r2")]
    assert not torch.equal(per_layer[0], per_layer[1])

    def error(chs):
        m = torch.zeros(6, dtype=torch.bool)
        m[list(chs)] = True
        return sum(float(w[n][:, ~m].pow(2).sum()) for n in ("r1", "r2")) + \
            sum(float(w[n][~m].pow(2).sum()) for n in ("w1", "w2"))
    best = min(itertools.combinations(range(6), 3), key=error)
    assert kept.nonzero().flatten().tolist() == list(best)
    readers_only = sum(w[n].pow(2).sum((0, 2, 3)) for n in ("r1", "r2")).topk(3).indices.sort().values.tolist()
    writers_only = sum(w[n].pow(2).flatten(1).sum(1) for n in ("w1", "w2")).topk(3).indices.sort().values.tolist()
    assert list(best) != readers_only and list(best) != writers_only   # every member counts
    # the writers' own input channels are their channel stage on what the group left them
    for n in ("w1", "w2"):
        assert torch.equal(masks[n][1], sparsity.structured_masks(w[n] * kept.view(-1, 1, 1, 1), specs[n])[1])


def test_stream_needs_one_keep_ratio_for_its_readers(single_process):
    import prunex_hvd as px
    model = Stream()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"same 'channel:K'.*a\.weight: 'channel:0\.5', c\.weight: 'channel:0\.25'"):
        px.DistributedOptimizer(opt, model, sparsity={"c.*": "channel:0.25", "*": "channel:0.5"}, coupled="streams")
    specs = {n: sparsity.parse_spec("filter:0.5" if n == "c.weight" else "channel:0.5")
             for n in ("stem.weight", "a.weight", "b.weight", "c.weight")}
    with pytest.raises(ValueError, match="same 'channel:K'"):   # the pure function checks it too
        sparsity.coupled_masks({n: p.detach() for n, p in model.named_parameters() if p.dim() == 4}, specs, {},
                               dependencies.channel_streams(model))
    # a stream member left dense: that stream keeps per-layer masks, and here nothing else is left to couple
    with pytest.raises(ValueError, match="nothing to couple"):
        px.DistributedOptimizer(opt, model, sparsity={"stem.*": "dense", "*": "channel:0.5"}, coupled="streams")


def test_optimizer_streams_finalize_whole_channels(single_process):
    """coupled="streams" on a real ResNet: after finalize() every channel of every stream is zero in all its
    readers and writers or in none, at the requested count; inside the blocks the pairs still hold."""
    import prunex_hvd as px
    torch.manual_seed(0)
    model = build("resnet_small", 4, 3)
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                  sparsity="channel:0.5", local_steps=2, rho1=0.1, rho2=0.1, freeze_round=2,
                                  coupled="streams")
    streams = opt._engine.masks.streams
    assert streams == dependencies.channel_streams(model) and len(streams) == 2
    assert opt._engine.masks.couplings == dependencies.channel_couplings(model)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))
    for _ in range(6):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt.stats()["frozen"]
    opt.finalize()
    w = dict(model.named_parameters())
    for readers, writers in streams:
        live = [w[n].detach().abs().sum((0, 2, 3)) != 0 for n in readers] + \
            [w[n].detach().flatten(1).abs().sum(1) != 0 for n in writers]
        assert all(torch.equal(m, live[0]) for m in live), (readers, writers)
        assert int(live[0].sum()) == len(live[0]) // 2
    for consumer, producer in opt._engine.masks.couplings.items():
        assert torch.equal(w[consumer].detach().abs().sum((0, 2, 3)) != 0,
                           w[producer].detach().flatten(1).abs().sum(1) != 0)


def test_resnet_blocks_couple_inside_never_across_the_residual():
    pairs = dependencies.channel_couplings(build("resnet18", 10, 3))
    assert len(pairs) == 8   # one per BasicBlock: conv2 reads conv1 alone
    assert all(c.endswith("conv2.weight") and p == c.replace("conv2", "conv1") for c, p in pairs.items())
    pairs = dependencies.channel_couplings(build("resnet50", 10, 3))
    assert len(pairs) == 32  # two per Bottleneck: conv2 <- conv1, conv3 <- conv2
    assert pairs["layer1.0.conv3.weight"] == "layer1.0.conv2.weight"
    assert pairs["layer1.0.conv2.weight"] == "layer1.0.conv1.weight"
    assert not any("shortcut" in c or "shortcut" in p for c, p in pairs.items())


class TwoReaders(nn.Module):
    """conv a feeds conv b and a second branch: a's filters are not b's alone."""

    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        h = torch.relu(self.bn(self.a(x)))
        return self.b(h) + h


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else x


def test_chain_through_bn_and_activations_couples():
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Dropout(0.1), nn.Conv2d(6, 5, 3),
                          nn.Flatten())
    assert dependencies.channel_couplings(model) == {"4.weight": "0.weight"}


def test_shared_output_and_grouped_convs_do_not_couple():
    assert dependencies.channel_couplings(TwoReaders()) == {}
    depthwise = nn.Sequential(nn.Conv2d(3, 6, 1), nn.ReLU(), nn.Conv2d(6, 6, 3, groups=6))
    assert dependencies.channel_couplings(depthwise) == {}


def test_tracing_leaves_models_running_in_other_threads_alone():
    """fx patches ``nn.Module.__call__`` for the whole process while it traces. The ranks of a threaded cluster
    that already train must neither fail nor land in the graph (CI saw both, before the tracer kept to its own
    thread), and every trace must be the model's own."""
    traced = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 5, 3), nn.Flatten())
    running = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1), nn.Flatten()).eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        expected = running(x)
    stop, failures, calls = threading.Event(), [], [0]

    def train_meanwhile():
        while not stop.is_set():
            try:
                with torch.no_grad():
                    assert torch.equal(running(x), expected)
                calls[0] += 1
            except BaseException as exc:   # noqa: BLE001 - reported by the main thread
                failures.append(exc)
                return

    other = threading.Thread(target=train_meanwhile, daemon=True)
    other.start()
    try:
        graphs = [str(dependencies.symbolic_trace(traced).graph) for _ in range(60)]
        couplings = [dependencies.channel_couplings(traced) for _ in range(20)]
    finally:
        stop.set()
        other.join(10)
    assert not failures, failures[0]
    assert calls[0] > 0 and len(set(graphs)) == 1 and "call_module" in graphs[0]
    assert all(c == {"3.weight": "0.weight"} for c in couplings)


def test_traces_in_several_threads_at_once_leave_torch_as_it_was():
    """Each rank of a threaded cluster traces its model while building its optimizer. Overlapping fx traces
    undo each other's patches out of order and can leave ``nn.Module.__call__`` patched for good (in CI every
    later test in the process failed); they must take turns."""
    call, getattr_ = nn.Module.__call__, nn.Module.__getattr__
    models = [nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Conv2d(6, 5, 3), nn.Flatten()) for _ in range(4)]
    graphs, failures = [[] for _ in models], []

    def trace_many(i):
        try:
            for _ in range(25):
                graphs[i].append(str(dependencies.symbolic_trace(models[i]).graph))
        except BaseException as exc:   # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=trace_many, args=(i,), daemon=True) for i in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures[0]
    assert nn.Module.__call__ is call and nn.Module.__getattr__ is getattr_
    assert len({g for gs in graphs for g in gs}) == 1 and all(len(gs) == 25 for gs in graphs)


def test_untraceable_model_is_a_clear_error():
    with pytest.raises(ValueError, match="torch.fx can trace.*DataDependent"):
        dependencies.channel_couplings(DataDependent())


def test_coupled_masks_are_the_exact_projection_onto_the_coupled_set():
    """With nothing else constraining the producer, keeping the k channel groups of largest joint norm is
    the Frobenius-nearest point: check against every subset."""
    g = torch.Generator().manual_seed(3)
    producer, consumer = torch.randn(6, 2, 3, 3, generator=g), torch.randn(4, 6, 3, 3, generator=g)
    consumer[:, 1] *= 3   # the consumer alone would keep channel 1; the producer's filter 2 outweighs it
    producer[2] *= 4
    specs = {"p": sparsity.parse_spec("channel:1"), "c": sparsity.parse_spec("channel:0.5")}
    masks = sparsity.coupled_masks({"p": producer, "c": consumer}, specs, {"c": "p"})
    kept = masks["p"][0]
    assert torch.equal(masks["c"][1].view(6, 9)[:, 0], kept) and int(kept.sum()) == 3
    assert masks["p"][1].all() and masks["c"][0].all()

    def error(chs):
        m = torch.zeros(6, dtype=torch.bool)
        m[list(chs)] = True
        return float(producer[~m].pow(2).sum() + consumer[:, ~m].pow(2).sum())
    best = min(itertools.combinations(range(6), 3), key=error)
    assert kept.nonzero().flatten().tolist() == list(best)
    projected = sparsity.coupled_project({"p": producer, "c": consumer}, specs, {"c": "p"})
    assert float((producer - projected["p"]).pow(2).sum() + (consumer - projected["c"]).pow(2).sum()) == \
        pytest.approx(error(best))


def test_chains_and_no_couplings():
    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(8, 8, 1, 1, generator=g) for n in ("a", "b", "c")}
    specs = {n: sparsity.parse_spec("channel:0.5") for n in w}
    plain = sparsity.coupled_masks(w, specs, {})
    for n in w:
        assert all(torch.equal(x, y) for x, y in zip(plain[n], sparsity.structured_masks(w[n], specs[n])))
    chain = sparsity.coupled_masks(w, specs, {"c": "b", "b": "a"})   # a -> b -> c
    assert torch.equal(chain["b"][0], chain["c"][1]) and torch.equal(chain["a"][0], chain["b"][1])
    assert [int(chain[n][0].sum()) * int(chain[n][1].sum()) for n in "abc"] == [16, 16, 32]
    # a producer's own filter stage is superseded by its consumer's channels
    specs["b"] = sparsity.parse_spec("filter:0.25+channel:0.5")
    assert int(sparsity.coupled_masks(w, specs, {"c": "b"})["b"][0].sum()) == 4


def test_optimizer_coupled_needs_something_to_couple(single_process):
    import prunex_hvd as px
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="nothing to couple"):
        px.DistributedOptimizer(opt, model, sparsity="channel:0.5", coupled=True)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="coupled must be False, True"):
            px.DistributedOptimizer(opt, model, sparsity="channel:0.5", coupled=bad)
    with pytest.raises(ValueError, match="coupled='streams', but no residual stream"):
        px.DistributedOptimizer(opt, model, sparsity="channel:0.5", coupled="streams")


def test_optimizer_coupled_finalizes_dead_filters_to_zero(single_process):
    import prunex_hvd as px
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 6, 3),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 2))
    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, sparsity="channel:0.5",
                                  local_steps=2, rho1=0.1, rho2=0.1, freeze_round=2, coupled=True)
    x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 2, (8,))
    for _ in range(6):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.finalize()
    dead_channels = model[3].weight.detach().abs().sum((0, 2, 3)) == 0
    dead_filters = model[0].weight.detach().reshape(8, -1).abs().sum(1) == 0
    assert int(dead_channels.sum()) == 4 and torch.equal(dead_channels, dead_filters)
    assert opt.stats()["density"] == pytest.approx((4 * 2 * 9 + 6 * 4 * 9) / (8 * 3 * 9 + 6 * 8 * 9))


def test_coupled_producer_keeps_every_filter_its_consumer_reads_at_any_kernel_position():
    """A shape stage on the consumer can drop kernel position 0 of a channel it still reads through other
    positions: the producer filter behind that channel must stay. (Reading the kept channels off position 0
    alone dropped every producer filter here while the consumer read 4 channels.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 6, 3))
    with torch.no_grad():
        model[3].weight[:, :, 0, 0] *= 1e-3   # kernel position 0: the smallest column of every channel
    w = {n: p.detach() for n, p in model.named_parameters() if p.dim() == 4}
    specs = {"0.weight": sparsity.parse_spec("channel:0.5"),
             "3.weight": sparsity.parse_spec("channel:0.5+shape:0.2")}
    couplings = dependencies.channel_couplings(model)
    assert couplings == {"3.weight": "0.weight"}
    masks = sparsity.coupled_masks(w, specs, couplings)
    consumer_cols = masks["3.weight"][1].view(8, 9)
    assert not consumer_cols[:, 0].any()          # the shape stage dropped position 0 everywhere
    read = consumer_cols.any(1)
    assert int(read.sum()) == 4
    assert torch.equal(masks["0.weight"][0], read)
    assert torch.equal(sparsity.read_channels(masks["3.weight"][1], 8), read)
    # the projected pair: a filter is zero exactly where no kept consumer column reads its channel
    projected = sparsity.coupled_project(w, specs, couplings)
    assert torch.equal(projected["0.weight"].flatten(1).abs().sum(1) != 0,
                       projected["3.weight"].abs().sum((0, 2, 3)) != 0)


class CalledTwice(nn.Module):
    """``a`` runs twice: its first call feeds ``b``, its second (reading ``b``) feeds ``c``; d -> e is a plain
    pair beside them."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)
        self.d, self.e = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        h = self.a(x)
        h = self.b(torch.relu(h))
        h = self.a(torch.relu(h))
        return self.c(torch.relu(h)) + self.e(torch.relu(self.d(x)))


def test_a_conv_called_twice_is_in_no_pair():
    """Its weight is used in two places: as the producer of b and of c, and as b's consumer. Any pair with it
    decides its filters for one call only, and the other call's reader reads pruned filters."""
    assert dependencies.channel_couplings(CalledTwice()) == {"e.weight": "d.weight"}
    # a conv consuming its own output through a second call
    loop = nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU())
    model = nn.Sequential(loop, loop, nn.Conv2d(4, 4, 1))
    assert dependencies.channel_couplings(model) == {}


def test_coupled_masks_refuses_a_producer_with_two_consumers_and_cycles():
    g = torch.Generator().manual_seed(1)
    w = {n: torch.randn(4, 4, 1, 1, generator=g) for n in "abc"}
    specs = {n: sparsity.parse_spec("channel:0.5") for n in w}
    with pytest.raises(ValueError, match=r"a is the producer of 2 consumers \(b, c\)"):
        sparsity.coupled_masks(w, specs, {"b": "a", "c": "a"})
    with pytest.raises(ValueError, match="cycle"):
        sparsity.coupled_masks(w, specs, {"b": "a", "a": "b"})


def test_tied_conv_weights_are_in_no_pair():
    """Two modules sharing one weight: the same weight in two places, as a conv called twice."""
    model = nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 1))
    assert dependencies.channel_couplings(model) == {"2.weight": "0.weight", "4.weight": "2.weight"}
    model[4].weight = model[0].weight
    assert dependencies.channel_couplings(model) == {}
