"""Horovod's MNIST example (``examples/pytorch/pytorch_mnist.py``) converted to PruneX. The wrap line is the one
that matters (``# PruneX``); everything else is what a Horovod user already has: hvd.init, DistributedSampler,
broadcast_parameters / broadcast_optimizer_state, Horovod's lr × size, metrics averaged with hvd.allreduce, and
Horovod's mixed-precision pattern (``--use-mixed-precision``). ``--optimizer horovod`` runs the same script under
``hvd.DistributedOptimizer``, to compare (``benchmarks/bench_dropin.py`` does, seed by seed).

    horovodrun -np 4 -H localhost:2,127.0.0.1:2 python examples/horovod_mnist.py
    horovodrun -np 8 -H node1:4,node2:4 python examples/horovod_mnist.py --use-mixed-precision

The data is the handwritten digits set that ships with the package (8×8 images, upsampled to 28×28 as MNIST's),
so the script runs without a download. It has 1,437 training images, 1/40 of MNIST's: at MNIST's batch of 64 a
rank of four would take 6 steps an epoch, so the batch here is 16.
"""
import argparse
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data.distributed
import horovod.torch as hvd

import prunex_hvd as px                                                      # PruneX
from prunex_hvd.app.data import load_dataset                                 # PruneX: MNIST-like, offline

parser = argparse.ArgumentParser(description="PyTorch digits example (Horovod's MNIST, with PruneX)")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--test-batch-size", type=int, default=256)
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--use-mixed-precision", action="store_true", help="autocast + GradScaler")
parser.add_argument("--sparsity", default="channel:0.5")                     # PruneX
parser.add_argument("--optimizer", default="prunex", choices=("prunex", "horovod"),   # PruneX: to compare,
                    help="horovod: the same script under hvd.DistributedOptimizer")   # the script unchanged
args = parser.parse_args()
args.cuda = torch.cuda.is_available()

hvd.init()
torch.manual_seed(args.seed)
if args.cuda:
    torch.cuda.set_device(hvd.local_rank())
    torch.cuda.manual_seed(args.seed)
torch.set_num_threads(1)
device = "cuda" if args.cuda else "cpu"


def dataset(x, y):
    x = F.interpolate(x.float() / 255.0, size=(28, 28), mode="bilinear", align_corners=False)
    return torch.utils.data.TensorDataset((x - 0.1307) / 0.3081, y)


data = load_dataset("digits", image_size=8)                                  # PruneX: MNIST-like, offline
train_dataset, test_dataset = dataset(data.train_x, data.train_y), dataset(data.test_x, data.test_y)
train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=hvd.size(),
                                                                rank=hvd.rank())
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
test_sampler = torch.utils.data.distributed.DistributedSampler(test_dataset, num_replicas=hvd.size(),
                                                               rank=hvd.rank())
test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


model = Net().to(device)
lr_scaler = hvd.size()   # Horovod's lr x size, kept for PruneX too (docs/tuning.md, "The learning rate")
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

if args.optimizer == "horovod":
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
else:                                                                         # PruneX: one round an epoch
    optimizer = px.DistributedOptimizer(optimizer, model, sparsity=args.sparsity, local_steps=len(train_loader))
# the autocast dtype of this device: float16 with a GradScaler on GPUs, bfloat16 on CPUs
amp_dtype = torch.float16 if args.cuda else torch.bfloat16
scaler = torch.amp.GradScaler(device) if args.use_mixed_precision else None


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        if scaler is not None:
            with torch.autocast(device, dtype=amp_dtype):
                output = model(data)
                loss = F.nll_loss(output, target)
            scaler.scale(loss).backward()
            optimizer.synchronize()               # make sure all async allreduces are done
            scaler.unscale_(optimizer)            # in-place unscaling of all gradients before the update
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()                       # in case of overflow / underflow
        else:
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
        if batch_idx % 10 == 0 and hvd.rank() == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]\tLoss: {loss.item():.6f}")


def metric_average(val, name):
    return hvd.allreduce(torch.tensor(val), name=name).item()


def test():
    model.eval()
    test_loss, test_accuracy = 0.0, 0.0
    pruned = optimizer.consensus_weights() if args.optimizer == "prunex" else contextlib.nullcontext()
    with pruned, torch.no_grad():                                           # PruneX: the pruned model so far
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            test_accuracy += output.max(1)[1].eq(target).float().sum().item()
    test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
    test_accuracy = metric_average(test_accuracy / len(test_sampler), "avg_accuracy")
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%\n")
    return test_accuracy


for epoch in range(1, args.epochs + 1):
    train(epoch)
    accuracy = test()

if args.optimizer == "prunex":
    optimizer.finalize()                                                      # PruneX: the pruned model
if hvd.rank() == 0:
    print(f"final accuracy {100.0 * accuracy:.2f}%")
if args.optimizer == "prunex" and hvd.rank() == 0:
    stats = optimizer.stats()                                                 # PruneX
    print(f"PruneX: density {stats['density']:.3f}, {stats['rounds']} rounds, "
          f"{stats['inter_bytes'] / 2**20:.2f} MiB across nodes (dense: {stats['dense_inter_bytes'] / 2**20:.2f})")
