"""In-memory image datasets and a sharded, resumable batch loader for data-parallel training.

Every dataset is held whole as uint8 tensors ``(N, C, H, W)`` already at the training resolution, so a batch is
one index into memory plus a vectorised augmentation; no worker processes, no files opened per sample.

* ``digits``    scikit-learn's 1797 real 8x8 handwritten digits (shipped with it, no download), 1 channel,
  resized to 16x16 by default. The embedded default: works offline, trains in seconds on a CPU.
* ``cifar10``   real CIFAR-10 read from ``--data-dir`` in the standard python-pickle layout.
* ``synthetic`` 10 classes of noisy low-frequency templates generated from a seed: for benchmarks, no files.

    data = load_dataset("digits")
    loader = ShardedLoader(data, batch_size=32, rank=rank, world_size=world, seed=0)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader.batches(start=0):   # start=k resumes mid-epoch, identical batches
            ...

Train shards come from :class:`torch.utils.data.DistributedSampler` (disjoint, equal, reshuffled per epoch) and
every rank gets the same number of full batches, so collective calls line up. The augmentation of batch ``b``
draws from a generator seeded by ``(seed, epoch, rank, b)`` alone: resuming at batch ``k`` needs no saved RNG state.
"""
from __future__ import annotations

import math
import os
import pickle
from dataclasses import dataclass, field
from typing import Iterator, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DistributedSampler

DATASETS = ("digits", "cifar10", "synthetic")
AUGMENTS = ("cifar", "shift", "none")

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

_DEFAULT_SIZE = {"digits": 16, "cifar10": 32, "synthetic": 32}
_SYNTH_CLASSES, _SYNTH_TRAIN, _SYNTH_TEST = 10, 2048, 512


@dataclass
class ImageData:
    """One dataset, both splits, in memory. Images are uint8 ``(N, C, H, W)``, labels int64 ``(N,)``.

    ``mean``/``std`` are per channel in [0, 1] units (what :class:`ShardedLoader` normalises with); ``augment``
    names the train-time augmentation: ``"cifar"`` (random crop, zero pad 4, + horizontal flip), ``"shift"``
    (random crop, zero pad 1 per 8 pixels, no flip: digits are not mirror symmetric) or ``"none"``.
    """
    name: str
    train_x: Tensor = field(repr=False)
    train_y: Tensor = field(repr=False)
    test_x: Tensor = field(repr=False)
    test_y: Tensor = field(repr=False)
    num_classes: int
    mean: tuple
    std: tuple
    augment: str

    @property
    def in_channels(self) -> int:
        return int(self.train_x.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.train_x.shape[-1])

    def __str__(self) -> str:
        return (f"{self.name}: {len(self.train_y)} train / {len(self.test_y)} test, {self.num_classes} classes, "
                f"{self.in_channels}x{self.image_size}x{self.image_size}, augment={self.augment}")


# ------------------------------------------------------------------------------------------------ loading

def load_dataset(name: str, data_dir: Optional[str] = None, image_size: Optional[int] = None,
                 seed: int = 0) -> ImageData:
    """Load ``name`` (one of :data:`DATASETS`) at ``image_size`` (default: 16 digits, 32 otherwise).

    ``data_dir`` is needed by ``cifar10`` only; ``seed`` only shapes ``synthetic`` (the digits split is fixed).
    Raises ValueError for an unknown name, a bad size, or missing / corrupt CIFAR files.
    """
    key = str(name).strip().lower()
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    size = _DEFAULT_SIZE[key] if image_size is None else image_size
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"image_size must be a positive integer, got {image_size!r}")
    size = int(size)
    if key == "digits":
        return _load_digits(size)
    if key == "cifar10":
        return _load_cifar10(data_dir, size)
    return _make_synthetic(size, seed)


def _resize_u8(x: Tensor, size: int, chunk: int = 4096) -> Tensor:
    """Bilinear resize of uint8 images (align_corners=False), rounded back to uint8; chunked to bound memory."""
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    out = torch.empty(x.shape[0], x.shape[1], size, size, dtype=torch.uint8)
    for i in range(0, x.shape[0], chunk):
        y = F.interpolate(x[i:i + chunk].float(), size=(size, size), mode="bilinear", align_corners=False)
        out[i:i + chunk] = y.round_().clamp_(0, 255).to(torch.uint8)
    return out


def _channel_stats(x: Tensor) -> Tuple[tuple, tuple]:
    """Per-channel mean/std of uint8 images in [0, 1] units (float64 so 50k images sum exactly enough)."""
    f = x.to(torch.float64).div_(255.0)
    mean = f.mean(dim=(0, 2, 3))
    std = f.std(dim=(0, 2, 3), unbiased=False).clamp_min(1e-6)
    return tuple(float(v) for v in mean), tuple(float(v) for v in std)


DIGITS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.npz")


def _load_digits(size: int) -> ImageData:
    """The 1,797 8×8 digits of UCI optdigits as scikit-learn ships them (``load_digits``), embedded in
    ``digits.npz`` with scikit-learn's split (``train_test_split(test_size=0.2, random_state=0, stratify=y)``),
    so that loading them costs no scikit-learn import (about a second per rank)."""
    with np.load(DIGITS_FILE) as f:
        counts, labels, tr, te = f["counts"], f["labels"], f["train"], f["test"]
    # Values are 0..16 counts of set pixels; stretch to the usual 0..255 range.
    x = torch.from_numpy(np.rint(counts.astype(np.float64) * (255.0 / 16.0)).astype(np.uint8)).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(labels.astype(np.int64))
    tr, te = torch.from_numpy(tr.astype(np.int64)), torch.from_numpy(te.astype(np.int64))
    x = _resize_u8(x, size)
    mean, std = _channel_stats(x[tr])
    return ImageData("digits", x[tr].contiguous(), y[tr].contiguous(), x[te].contiguous(), y[te].contiguous(),
                     num_classes=10, mean=mean, std=std, augment="shift")


def _cifar_folder(data_dir: str) -> str:
    # Accept the parent of cifar-10-batches-py (what the tarball extracts into) or the folder itself.
    nested = os.path.join(data_dir, CIFAR10_FOLDER)
    if os.path.isdir(nested):
        return nested
    if os.path.basename(os.path.normpath(data_dir)) == CIFAR10_FOLDER or \
            os.path.isfile(os.path.join(data_dir, CIFAR10_TRAIN_FILES[0])):
        return data_dir
    return nested


def _read_cifar_batch(path: str) -> Tuple[Tensor, Tensor]:
    """One CIFAR-10 pickle → (uint8 (n, 3, 32, 32), int64 (n,)); ValueError naming the file on any defect."""
    try:
        with open(path, "rb") as f:
            # The files are pickles by format; only point --data-dir at a copy you trust.
            batch = pickle.load(f, encoding="bytes")
    except Exception as e:  # truncated, garbage, wrong protocol...: all mean "not this format"
        raise ValueError(f"{path}: cannot unpickle CIFAR-10 batch ({type(e).__name__}: {e}); "
                         f"re-extract it from {CIFAR10_URL}") from None
    if not isinstance(batch, dict):
        raise ValueError(f"{path}: expected a pickled dict, got {type(batch).__name__}")
    missing = [k for k in (b"data", b"labels") if k not in batch]
    if missing:
        raise ValueError(f"{path}: missing key(s) {', '.join(map(repr, missing))}; "
                         f"keys present: {sorted(map(repr, batch))}")
    data = batch[b"data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        desc = (f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray)
                else type(data).__name__)
        raise ValueError(f"{path}: b'data' must be a uint8 array of shape (n, 3072), got {desc}")
    try:
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: b'labels' is not a list of integers ({e})") from None
    if labels.ndim != 1 or len(labels) != len(data):
        raise ValueError(f"{path}: {len(data)} images but b'labels' has shape {labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{path}: labels must lie in 0..9, found range {labels.min()}..{labels.max()}")
    # Each row is the R plane, then G, then B, each 32x32 row-major: exactly (3, 32, 32) channel-first.
    x = torch.from_numpy(np.ascontiguousarray(data).reshape(-1, 3, 32, 32).copy())
    return x, torch.from_numpy(labels)


def _load_cifar10(data_dir: Optional[str], size: int) -> ImageData:
    if data_dir is None:
        raise ValueError(f"cifar10 needs --data-dir (data_dir): the folder holding {CIFAR10_FOLDER}/ "
                         f"extracted from {CIFAR10_URL}")
    folder = _cifar_folder(os.fspath(data_dir))
    expected = CIFAR10_TRAIN_FILES + (CIFAR10_TEST_FILE,)
    missing = [f for f in expected if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise ValueError(
            f"CIFAR-10 not found: looked in {folder} for {', '.join(expected)} (missing: {', '.join(missing)}). "
            f"Download {CIFAR10_URL} and extract it into the data dir (tar xzf cifar-10-python.tar.gz -C DIR) "
            f"so that DIR/{CIFAR10_FOLDER}/data_batch_1 exists; pass DIR or DIR/{CIFAR10_FOLDER}.")
    parts = [_read_cifar_batch(os.path.join(folder, f)) for f in CIFAR10_TRAIN_FILES]
    train_x = torch.cat([p[0] for p in parts])
    train_y = torch.cat([p[1] for p in parts])
    test_x, test_y = _read_cifar_batch(os.path.join(folder, CIFAR10_TEST_FILE))
    return ImageData("cifar10", _resize_u8(train_x, size), train_y, _resize_u8(test_x, size), test_y,
                     num_classes=10, mean=CIFAR10_MEAN, std=CIFAR10_STD, augment="cifar")


def _make_synthetic(size: int, seed: int) -> ImageData:
    """10 classes, each a fixed random smooth colour template; an image is template + per-pixel noise + a
    per-image brightness shift, clipped to uint8. Linearly separable in expectation, yet not trivial per pixel."""
    g = torch.Generator().manual_seed(int(seed))
    coarse = torch.randn(_SYNTH_CLASSES, 3, 4, 4, generator=g)         # 4x4 grid = low frequency only
    templates = 128.0 + 60.0 * F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)

    def split(n: int) -> Tuple[Tensor, Tensor]:
        y = (torch.arange(n) % _SYNTH_CLASSES)[torch.randperm(n, generator=g)]   # balanced classes
        noise = 70.0 * torch.randn(n, 3, size, size, generator=g)
        shift = 30.0 * torch.randn(n, 1, 1, 1, generator=g)
        x = (templates[y] + noise + shift).round_().clamp_(0, 255).to(torch.uint8)
        return x, y.to(torch.int64)

    train_x, train_y = split(_SYNTH_TRAIN)
    test_x, test_y = split(_SYNTH_TEST)
    mean, std = _channel_stats(train_x)
    return ImageData("synthetic", train_x, train_y, test_x, test_y,
                     num_classes=_SYNTH_CLASSES, mean=mean, std=std, augment="none")


# ------------------------------------------------------------------------------------------------ augmentation

def crop_padding(augment: str, image_size: int) -> int:
    """Zero padding of the random crop: 4 px at 32 for ``cifar``, 1 px per 8 for ``shift``, scaled with size."""
    if augment == "cifar":
        return max(1, round(4 * image_size / 32))
    if augment == "shift":
        return max(1, round(image_size / 8))
    return 0


def _batch_seed(seed: int, epoch: int, rank: int, index: int) -> int:
    # SeedSequence mixes the tuple well: neighbouring batches/ranks get unrelated streams.
    ss = np.random.SeedSequence([int(v) % 2**63 for v in (seed, epoch, rank, index)])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> 1)


def augment_batch(x: Tensor, augment: str, generator: torch.Generator) -> Tensor:
    """Random crop (zero pad) and, for ``cifar``, horizontal flip, each sample its own draw; uint8 in and out.

    One advanced-indexing gather does crop and flip together. Random numbers are drawn on the CPU generator in a
    fixed order (offsets y, offsets x, flips) so the result does not depend on the device ``x`` lives on.
    """
    if augment not in AUGMENTS:
        raise ValueError(f"unknown augment {augment!r}; valid: {', '.join(AUGMENTS)}")
    if augment == "none" or x.shape[0] == 0:
        return x
    n, c, h, w = x.shape
    pad = crop_padding(augment, w)
    oy = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    ox = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    rows = oy[:, None] + torch.arange(h)                                   # (n, h)
    cols = ox[:, None] + torch.arange(w)                                   # (n, w)
    if augment == "cifar":
        flip = torch.rand(n, generator=generator) < 0.5
        cols = torch.where(flip[:, None], cols.flip(1), cols)
    dev = x.device
    padded = F.pad(x, (pad, pad, pad, pad))
    return padded[torch.arange(n, device=dev)[:, None, None, None], torch.arange(c, device=dev)[None, :, None, None],
                  rows.to(dev)[:, None, :, None], cols.to(dev)[:, None, None, :]]


# ------------------------------------------------------------------------------------------------ loader

class ShardedLoader:
    """Disjoint equal shards per rank; per-epoch shuffle seed; every rank gets the same number of batches.

    Train (``train=True``): :class:`DistributedSampler` with ``drop_last=True`` and ``set_epoch``, then the
    incomplete last batch is dropped, so each rank yields ``len(self)`` full batches of ``batch_size``. Batch ``b``
    is augmented with a generator seeded from ``(seed, epoch, rank, b)``, so ``batches(start=k)`` reproduces an
    uninterrupted pass from batch ``k`` on, bit for bit.

    Eval (``train=False``): rank ``r`` gets test indices ``r::world_size`` in order, no augmentation, last
    batch partial; shard sizes may differ by one sample (and batch counts by one), which eval code must allow.

    The split is moved to ``device`` once at construction; batches are float32 normalised ``x`` and int64 ``y``.
    """

    def __init__(self, data: ImageData, batch_size: int, rank: int, world_size: int, seed: int = 0,
                 train: bool = True, device="cpu"):
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if int(world_size) < 1 or not 0 <= int(rank) < int(world_size):
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if data.augment not in AUGMENTS:
            raise ValueError(f"{data.name}: unknown augment {data.augment!r}; valid: {', '.join(AUGMENTS)}")
        self.data, self.batch_size, self.rank, self.world_size = data, int(batch_size), int(rank), int(world_size)
        self.seed, self.train, self.device = int(seed), bool(train), torch.device(device)
        self.epoch = 0
        x, y = (data.train_x, data.train_y) if self.train else (data.test_x, data.test_y)
        self._x, self._y = x.to(self.device), y.to(self.device)
        self._mean = torch.tensor(data.mean, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        self._std = torch.tensor(data.std, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        n = len(y)
        if self.train:
            self._sampler = DistributedSampler(range(n), num_replicas=self.world_size, rank=self.rank,
                                               shuffle=True, seed=self.seed, drop_last=True)
            self._len = self._sampler.num_samples // self.batch_size
            if self._len == 0:
                raise ValueError(
                    f"{data.name}: {n} training samples over {self.world_size} rank(s) give "
                    f"{self._sampler.num_samples} per rank, fewer than batch_size={self.batch_size}: no full batch. "
                    f"Need at least batch_size x world_size = {self.batch_size * self.world_size} samples.")
        else:
            self._sampler = None
            self._eval_idx = torch.arange(self.rank, n, self.world_size)
            self._len = math.ceil(len(self._eval_idx) / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch: reshuffles the train shards and the augmentation streams (no-op order for eval)."""
        self.epoch = int(epoch)
        if self._sampler is not None:
            self._sampler.set_epoch(self.epoch)

    def __len__(self) -> int:
        return self._len

    @property
    def num_samples(self) -> int:
        """Samples this rank yields per epoch (train: ``len(self) * batch_size``)."""
        return self._len * self.batch_size if self.train else len(self._eval_idx)

    def indices(self) -> Tensor:
        """This rank's sample indices for the current epoch, in yield order (only those that are yielded)."""
        if not self.train:
            return self._eval_idx.clone()
        return torch.tensor(list(iter(self._sampler)), dtype=torch.int64)[:self.num_samples]

    def batches(self, start: int = 0) -> Iterator[Tuple[Tensor, Tensor]]:
        """Yield ``(x, y)`` for batch indices ``start .. len(self)-1`` of the current epoch."""
        if not 0 <= int(start) <= self._len:
            raise ValueError(f"start must be in 0..{self._len} (batches per epoch), got {start}")
        return self._iter(int(start), self.indices(), self.epoch)   # epoch captured now, not at first next()

    def _iter(self, start: int, idx: Tensor, epoch: int) -> Iterator[Tuple[Tensor, Tensor]]:
        bs = self.batch_size
        for b in range(start, self._len):
            yield self.batch_of(idx[b * bs:(b + 1) * bs], epoch, (self.rank, b))

    def batch_of(self, sel: Tensor, epoch: int, stream: Tuple[int, int]) -> Tuple[Tensor, Tensor]:
        """The samples ``sel`` as a normalised batch; train batches augmented with a generator seeded from
        ``(seed, epoch, *stream)`` (:meth:`batches` passes (rank, batch index))."""
        sel = sel.to(self.device)
        x = self._x[sel]
        if self.train and self.data.augment != "none":
            g = torch.Generator().manual_seed(_batch_seed(self.seed, epoch, *stream))
            x = augment_batch(x, self.data.augment, g)
        x = (x.to(torch.float32).div_(255.0) - self._mean).div_(self._std)
        return x, self._y[sel]

    def permutation(self, epoch: int) -> Tensor:
        """The epoch's order of the whole training set, the same on every rank (what the train shards split)."""
        g = torch.Generator().manual_seed(self.seed + int(epoch))
        return torch.randperm(len(self._y), generator=g)
