"""PacTrain on a real launch, checked step by step on rank 0 against the dense reference.

Each rank trains a small CNN on its own data, once plain and once with TernGrad. Around every step the
ranks' pre-communication gradients, post-communication gradients and weights are gathered to rank 0 over
the launcher's control plane (never through the accounted groups). Rank 0 checks:

* plain: the synchronised gradient equals the dense average of the masked gradients, in the full-sync steps
  and in the compact ones (the tracker's indices, allreduce of the gathered entries, scatter back);
* with TernGrad (the second run): what each rank sent is int8 in {-1, 0, 1} (0 where the masked gradient
  is 0), the shared scale is the world's max |g| of each payload, and the result is ``s·Σt/N`` of what the
  ranks sent;
* the weights are identical on every rank and exactly 0 where pruned.

Writes OUT/rank{R}.json with the per-step byte deltas and the bucket sizes for the parent test."""
import argparse

import torch
import torch.nn as nn

import worker_io

TOL = dict(rtol=1e-5, atol=1e-7)   # float32 sums in another order


def make_model():
    torch.manual_seed(1234)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 5))


def payloads_of(grads, names, lay, idx, travel):
    """The flat buckets of ``grads`` as PacTrain lays them out, compacted by ``idx`` (None: full)."""
    bufs = [torch.zeros(b.numel()) for b in lay.buffers]
    for k, n in enumerate(names):
        b, off = lay.place[k]
        bufs[b][off: off + grads[n].numel()] = grads[n].reshape(-1)
    return [bufs[b] if idx is None else bufs[b][idx[b]] for b in travel]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="mpi")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--patience", type=int, default=2)
    ap.add_argument("--modes", default="plain,terngrad,structured",
                    help="runs, one after the other: plain, terngrad, structured (PruneX's channels at init)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import prunex_hvd as px
    topo = px.init(backend=a.backend)
    result = {"rank": topo.rank, "topology": topo.as_dict()}
    for mode in a.modes.split(","):
        result[mode] = run(a, mode == "terngrad", "structured" if mode == "structured" else "unstructured")
    worker_io.report(a.out, topo.rank, result, sum(result[m]["checks"] for m in a.modes.split(",")))


def run(a, terngrad, structure):
    from prunex_hvd.baselines import pactrain
    from prunex_hvd.dist.runtime import state
    topo, control = state()
    model = make_model()
    if topo.rank != 0:   # different starting points: construction must broadcast rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    opt = pactrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
                                        model, sparsity="channel:0.5", patience=a.patience, terngrad=terngrad,
                                        bucket_mb=0.002, backend=a.backend, seed=7, structure=structure)
    world, lay = opt._world, opt._layout
    names = [n for n, _ in model.named_parameters()]
    masks = {n: m.clone() for n, m in opt._masks.items()}
    every = control.allgather_object(masks)   # every rank chose the same masks, without talking
    assert all(torch.equal(m[n], masks[n]) for m in every for n in masks), "masks differ across ranks"

    sent = []   # this step's int8 payloads as sent, and the shared scales as received
    orig = type(world).allreduce_

    def spy(t, op="sum"):
        if t.dtype == torch.int8:
            sent.append(("t", t.clone()))
        out = orig(world, t, op)
        if op == "max":
            sent.append(("s", t.clone()))
        return out
    world.allreduce_ = spy

    def weights_check(when):
        ws = control.allgather_object({n: p.detach().clone() for n, p in model.named_parameters()})
        if topo.rank == 0:
            for n in names:
                assert all(torch.equal(w[n], ws[0][n]) for w in ws), f"{when}: {n} differs across ranks"
                if n in masks:
                    assert torch.all(ws[0][n][~masks[n]] == 0), f"{when}: pruned weights of {n} are not 0"

    weights_check("after construction")
    g = torch.Generator().manual_seed(100 + topo.rank)   # different data on every rank
    x = torch.randn(16, 3, 6, 6, generator=g)
    y = torch.randint(0, 5, (16,), generator=g)
    steps, checks = [], 0
    for step in range(a.steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre = control.allgather_object({n: p.grad.clone() for n, p in model.named_parameters()})
        before = opt.stats()["inter_bytes"]
        sent.clear()
        opt.step()
        stats = opt.stats()
        post = control.allgather_object({n: p.grad.clone() for n, p in model.named_parameters()})
        sent_all = control.allgather_object(list(sent))
        stable = stats["mask_stable"]
        idx = [i.clone() for i in opt._tracker.indices()] if stable else None
        steps.append({"stable": stable, "inter": stats["inter_bytes"] - before,
                      "compact": [int(i.numel()) for i in idx] if stable else None})
        if topo.rank == 0:
            n_world = len(pre)
            masked = [{n: pre[r][n] * masks[n] if n in masks else pre[r][n] for n in names} for r in range(n_world)]
            if not terngrad:
                for n in names:
                    want = torch.stack([m[n] for m in masked]).sum(0) / n_world
                    for r in range(n_world):
                        phase = "compact" if stable else "full"
                        worker_io.assert_close(post[r][n], want, f"step {step} ({phase}) rank {r} grad {n}", **TOL)
                        assert torch.equal(post[r][n], post[0][n])
            else:
                # the flat payloads each rank put on the wire, rebuilt from its masked gradient
                travel = [b for b in range(len(lay.buffers)) if not stable or idx[b].numel()]  # empty: stay home
                payloads = [payloads_of(m, names, lay, idx, travel) for m in masked]
                scales = [v for kind, v in sent_all[0] if kind == "s"]
                assert len(scales) == 1, scales
                s = scales[0]
                for r in range(n_world):
                    assert torch.equal(next(v for kind, v in sent_all[r] if kind == "s"), s), "scales differ"
                want_s = torch.stack([torch.stack([p.abs().max() for p in pl]) for pl in payloads]).amax(0)
                worker_io.assert_close(s, want_s, f"step {step} shared scale", **TOL)
                ts = [[v for kind, v in sent_all[r] if kind == "t"] for r in range(n_world)]
                ref_bufs = [torch.zeros(b.numel()) for b in lay.buffers]
                assert all(len(ts[r]) == len(travel) for r in range(n_world)), "one int8 allreduce per payload"
                for j, b in enumerate(travel):
                    for r in range(n_world):
                        t = ts[r][j]
                        assert t.dtype == torch.int8 and set(t.unique().tolist()) <= {-1, 0, 1}
                        assert torch.all(t[payloads[r][j] == 0] == 0), "a zero gradient was sent as ±1"
                        assert torch.all(t * torch.sign(payloads[r][j]).to(torch.int8) >= 0), "sign flipped"
                    total = torch.stack([ts[r][j] for r in range(n_world)]).sum(0)
                    value = total.float() * (s[j] / n_world)
                    if stable:
                        ref_bufs[b][idx[b]] = value
                    else:
                        ref_bufs[b] = value
                for k, n in enumerate(names):
                    b, off = lay.place[k]
                    want = ref_bufs[b][off: off + pre[0][n].numel()].view_as(pre[0][n])
                    for r in range(n_world):
                        phase = "compact" if stable else "full"
                        worker_io.assert_close(post[r][n], want, f"step {step} ({phase}) rank {r} terngrad {n}", **TOL)
            checks += 1
        weights_check(f"after step {step}")
    stats_before_finalize = opt.stats()
    opt.finalize()
    bufs = control.allgather_object({n: b.clone() for n, b in model.named_buffers() if b.is_floating_point()})
    for n in bufs[0]:
        assert all(torch.equal(b[n], bufs[0][n]) for b in bufs), f"buffer {n} differs after finalize"
    assert opt.stats() == stats_before_finalize, "finalize's one-time buffer average is not step traffic"
    del world.allreduce_
    return {"checks": checks, "steps": steps, "stats": stats_before_finalize,
            "bucket_numels": [b.numel() for b in lay.buffers],
            "numels": {n: p.numel() for n, p in model.named_parameters()},
            "pruned": {n: [int(m.sum()), m.numel()] for n, m in masks.items()},
            # input channels kept whole (all of a channel's entries) and kept at all, of C_in
            "channels": {n: [int(m.flatten(2).all(2).all(0).sum()), int(m.flatten(2).any(2).any(0).sum()), m.shape[1]]
                         for n, m in masks.items()},
            "int8_wire_itemsize": world.wire_dtype(torch.int8).itemsize,
            "world_nodes": list(world.nodes)}

if __name__ == "__main__":
    worker_io.run(main, "pactrain")
