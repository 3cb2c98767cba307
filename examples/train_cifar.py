"""An ordinary PyTorch training loop with PruneX: the only prunex-specific lines are marked `# <- prunex`.

    horovodrun -np 8 -H node1:4,node2:4 python examples/train_cifar.py --data-dir data --epochs 30
    mpirun -np 4 -x PRUNEX_RANKS_PER_NODE=2 python examples/train_cifar.py --dataset digits --epochs 5

Every rank trains on its own shard; every `local_steps` steps the wrapped optimizer runs one H-SADMM round
(node average, compact exchange between node leaders, on the channels chosen at the start). At the end,
`finalize()` leaves the same structurally pruned model on every rank.
"""
import argparse

import torch
import torch.nn.functional as F

import prunex_hvd as px
from prunex_hvd.app.data import ShardedLoader, load_dataset
from prunex_hvd.app.models import build, default_image_size

ap = argparse.ArgumentParser()
ap.add_argument("--dataset", default="cifar10", choices=("cifar10", "digits", "synthetic"))
ap.add_argument("--data-dir", default="data")
ap.add_argument("--model", default="resnet18")
ap.add_argument("--epochs", type=int, default=30)
ap.add_argument("--batch-size", type=int, default=128)
ap.add_argument("--lr", type=float, default=0.05)
ap.add_argument("--sparsity", default="channel:0.5")
args = ap.parse_args()

topo = px.init()                                                                   # <- prunex
data = load_dataset(args.dataset, data_dir=args.data_dir, image_size=default_image_size(args.model))
train = ShardedLoader(data, args.batch_size, topo.rank, topo.size, seed=0, train=True)
test = ShardedLoader(data, 256, topo.rank, topo.size, train=False)

torch.manual_seed(0)
model = build(args.model, num_classes=data.num_classes, in_channels=data.in_channels)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
optimizer = px.DistributedOptimizer(optimizer, model, sparsity=args.sparsity,     # <- prunex
                                    local_steps=len(train))                         # one round per epoch
# the defaults are the measured recipe (help(px.ConsensusConfig) is the tuning guide); the lr is ours: warmed up over
# the first two epochs (at most an eighth of the run), then a cosine, as prunex-hvd train does. A deep model at this lr
# diverges without the warm-up in its first rounds, when every node steps alone on its own batch.
warm = max(1, min(2 * len(train), args.epochs * len(train) // 8))
warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / warm, total_iters=warm)
cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, args.epochs * len(train) - warm))
scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[warm])

for epoch in range(args.epochs):
    train.set_epoch(epoch)
    model.train()
    for x, y in train.batches():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        scheduler.step()
    if topo.rank == 0:
        s = optimizer.stats()                                                        # <- prunex
        print(f"epoch {epoch + 1}: round {s['rounds']}, density {s['density']:.3f}, "
              f"inter-node {s['inter_bytes'] / 2**20:.2f} MB sent by this rank")

optimizer.finalize()                                                                 # <- prunex
model.eval()
correct = total = 0
with torch.no_grad():
    for x, y in test.batches():
        correct += int((model(x).argmax(1) == y).sum())
        total += len(y)
print(f"rank {topo.rank}: pruned model, {correct}/{total} correct on its test shard")
