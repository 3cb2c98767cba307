"""Top-K with error feedback on a real launch, checked step by step against a plain reference.

Each rank trains a small CNN on its own data. Around every step the ranks' gradients and residuals are
gathered to rank 0 over the launcher's control plane (never through the accounted groups), and rank 0
recomputes the step plainly — per rank and layer ``topk_compress(grad + residual, k)``, dense-ified, averaged
over ranks (or a plain average during warm-up) — and compares every rank's communicated gradient and new
residual with it, and checks that all ranks hold identical weights. Writes OUT/rank{R}.json with the
ledger, stats and the numbers the parent test needs for the byte formula."""
import argparse
import math

import torch
import torch.nn as nn

import worker_io


def make_model():
    torch.manual_seed(1234)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 5))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--bucket-mb", type=float, default=0.002)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import prunex_hvd as px
    from prunex_hvd.baselines import topk
    from prunex_hvd.dist.runtime import state
    topo = px.init(backend=a.backend)
    control = state()[1]
    model = make_model()
    if topo.rank != 0:   # different starting points: construction must broadcast rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    opt = topk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                    ratio=a.ratio, warmup_steps=a.warmup_steps, bucket_mb=a.bucket_mb,
                                    backend=a.backend)
    start = control.allgather_object([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(s, t) for other in start for s, t in zip(other, start[0])), \
        "weights differ after construction"
    px.comm.reset()
    params = [p for p in model.parameters()]
    numels = [p.numel() for p in params]
    ks = [max(1, math.ceil(a.ratio * n)) for n in numels]
    g = torch.Generator().manual_seed(100 + topo.rank)   # different data on every rank
    checks = 0
    for step in range(a.steps):
        x = torch.randn(16, 3, 6, 6, generator=g)
        y = torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        before = control.allgather_object({"grads": [p.grad.detach().clone() for p in params],
                                           "residual": opt._residual.clone()})
        opt.step()
        after = control.allgather_object({"grads": [p.grad.detach().clone() for p in params],
                                          "residual": opt._residual.clone(),
                                          "weights": [p.detach().clone() for p in params]})
        if topo.rank == 0:
            world = len(before)
            warm = step < a.warmup_steps
            want_grads, want_res = [torch.zeros_like(p) for p in params], []
            for r in range(world):
                flat_res = before[r]["residual"]
                res_r, off = [], 0
                for li, (grad, n, k) in enumerate(zip(before[r]["grads"], numels, ks)):
                    acc = grad.reshape(-1) + flat_res[off:off + n]
                    if warm:
                        sent, res = grad.reshape(-1), flat_res[off:off + n]
                    else:
                        values, idx, res = topk.topk_compress(acc, k)
                        assert idx.dtype == torch.int32 and values.numel() == k
                        sent = torch.zeros_like(acc)
                        sent[idx.long()] = values
                    want_grads[li] += sent.view_as(grad) / world
                    res_r.append(res)
                    off += n
                want_res.append(torch.cat(res_r))
            for r, got in enumerate(after):
                for li, (gg, ww) in enumerate(zip(got["grads"], want_grads)):
                    torch.testing.assert_close(gg, ww, rtol=1e-5, atol=1e-7,
                                               msg=lambda m: f"step {step} rank {r} layer {li} grad: {m}")
                torch.testing.assert_close(got["residual"], want_res[r], rtol=0, atol=0,
                                           msg=lambda m: f"step {step} rank {r} residual: {m}")
                for li, (w, w0) in enumerate(zip(got["weights"], after[0]["weights"])):
                    assert torch.equal(w, w0), f"step {step}: rank {r} layer {li} weights differ from rank 0's"
                checks += 1
    layout = opt._layout
    result = {"rank": topo.rank, "topology": topo.as_dict(), "stats": opt.stats(),
              "ledger": px.comm.summary(by_op=True), "checks": checks, "numels": numels, "ks": ks,
              "bucket_numels": [b.numel() for b in layout.buffers] if layout is not None else [],
              "steps": a.steps, "warmup_steps": a.warmup_steps}
    worker_io.report(a.out, topo.rank, result, checks)


if __name__ == "__main__":
    worker_io.run(main, "topk")
