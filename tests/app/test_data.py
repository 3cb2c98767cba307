"""Datasets (digits, a tiny CIFAR-10 written in the real pickle format, synthetic) and the sharded loader."""
import os
import pickle

import numpy as np
import pytest
import torch

from prunex_hvd.app.data import DATASETS, ImageData, ShardedLoader, load_dataset


# (the digits fixture is in conftest.py)

# ------------------------------------------------------------------------------------------------ digits

def test_digits_shapes_split_and_stats(digits):
    d = digits
    assert d.name == "digits" and d.num_classes == 10 and d.augment == "shift"
    assert d.in_channels == 1 and d.image_size == 16
    assert d.train_x.shape == (1437, 1, 16, 16) and d.test_x.shape == (360, 1, 16, 16)
    assert len(d.train_y) + len(d.test_y) == 1797
    assert d.train_x.dtype == torch.uint8 and d.train_y.dtype == torch.int64 and d.test_y.dtype == torch.int64
    assert set(d.train_y.tolist()) == set(range(10)) == set(d.test_y.tolist())
    assert d.train_x.max() > 200                        # 0..16 stretched to 0..255
    f = d.train_x.double() / 255
    assert d.mean[0] == pytest.approx(f.mean().item()) and d.std[0] == pytest.approx(f.std(unbiased=False).item())


def test_digits_deterministic_and_resize(digits):
    again = load_dataset("digits")
    assert torch.equal(again.train_x, digits.train_x) and torch.equal(again.test_y, digits.test_y)
    big = load_dataset("digits", image_size=32)
    assert big.train_x.shape == (1437, 1, 32, 32) and big.image_size == 32
    assert torch.equal(big.train_y, digits.train_y)     # same split whatever the size


def test_the_embedded_digits_are_scikit_learn_s_with_its_split(digits):
    """digits.npz holds exactly what sklearn.datasets.load_digits returns, split as
    train_test_split(test_size=0.2, random_state=0, stratify=y) splits it (scikit-learn: the dev extra)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    bunch = load_digits()
    tr, te = train_test_split(np.arange(len(bunch.target)), test_size=0.2, random_state=0, stratify=bunch.target)
    x = torch.from_numpy(np.rint(bunch.data * (255.0 / 16.0)).astype(np.uint8)).reshape(-1, 1, 8, 8)
    small = load_dataset("digits", image_size=8)
    assert torch.equal(small.train_x, x[tr]) and torch.equal(small.test_x, x[te])
    assert torch.equal(small.train_y, torch.from_numpy(bunch.target[tr])) and \
        torch.equal(small.test_y, torch.from_numpy(bunch.target[te]))


def test_unknown_name_and_bad_size():
    with pytest.raises(ValueError, match="digits, cifar10, synthetic"):
        load_dataset("mnist")
    with pytest.raises(ValueError, match="image_size"):
        load_dataset("digits", image_size=0)
    assert DATASETS == ("digits", "cifar10", "synthetic")


# ------------------------------------------------------------------------------------------------ cifar10

def _pattern(n, offset):
    """(n, 3072) uint8 with a known value at image i, channel c, row r, col q: (offset + i + 7c + 3r + q) % 256."""
    i, c, r, q = np.meshgrid(np.arange(n), np.arange(3), np.arange(32), np.arange(32), indexing="ij")
    return ((offset + i + 7 * c + 3 * r + q) % 256).astype(np.uint8).reshape(n, 3072)


def _write(path, data, labels):
    with open(path, "wb") as f:
        pickle.dump({b"batch_label": b"test", b"labels": labels, b"data": data,
                     b"filenames": [b"f%d.png" % i for i in range(len(labels))]}, f)


@pytest.fixture
def cifar_dir(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for b in range(1, 6):
        _write(folder / f"data_batch_{b}", _pattern(8, 10 * b), [(b + i) % 10 for i in range(8)])
    _write(folder / "test_batch", _pattern(8, 100), list(range(8)))
    return tmp_path


def test_cifar_loads_with_pixel_layout(cifar_dir):
    d = load_dataset("cifar10", data_dir=str(cifar_dir))
    assert d.train_x.shape == (40, 3, 32, 32) and d.test_x.shape == (8, 3, 32, 32) and d.train_x.dtype == torch.uint8
    assert d.train_y.tolist()[:8] == [(1 + i) % 10 for i in range(8)] and d.test_y.tolist() == list(range(8))
    assert d.augment == "cifar" and d.mean == (0.4914, 0.4822, 0.4465) and d.in_channels == 3
    # image 9 = batch 2 image 1; channel 2, row 5, column 11
    assert d.train_x[9, 2, 5, 11].item() == (20 + 1 + 14 + 15 + 11) % 256
    assert d.test_x[3, 1, 0, 31].item() == (100 + 3 + 7 + 0 + 31) % 256
    inner = load_dataset("cifar10", data_dir=str(cifar_dir / "cifar-10-batches-py"))
    assert torch.equal(inner.train_x, d.train_x) and torch.equal(inner.test_y, d.test_y)
    small = load_dataset("cifar10", data_dir=str(cifar_dir), image_size=16)
    assert small.train_x.shape == (40, 3, 16, 16)


def test_cifar_missing(tmp_path):
    with pytest.raises(ValueError, match="--data-dir"):
        load_dataset("cifar10")
    with pytest.raises(ValueError, match="cifar-10-batches-py") as e:
        load_dataset("cifar10", data_dir=str(tmp_path))
    assert "data_batch_1" in str(e.value) and "cifar-10-python.tar.gz" in str(e.value)


def test_cifar_one_file_missing(cifar_dir):
    os.remove(cifar_dir / "cifar-10-batches-py" / "data_batch_4")
    with pytest.raises(ValueError, match="missing: data_batch_4"):
        load_dataset("cifar10", data_dir=str(cifar_dir))


def test_cifar_truncated_pickle(cifar_dir):
    path = cifar_dir / "cifar-10-batches-py" / "data_batch_3"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="data_batch_3"):
        load_dataset("cifar10", data_dir=str(cifar_dir))


@pytest.mark.parametrize("data, labels, message", [
    (np.zeros((8, 3000), np.uint8), list(range(8)), r"shape \(n, 3072\)"),
    (np.zeros((8, 3072), np.float32), list(range(8)), "uint8"),
    (np.zeros((8, 3072), np.uint8), list(range(7)), "8 images"),
    (np.zeros((8, 3072), np.uint8), [0] * 7 + [10], "0..9"),
])
def test_cifar_malformed(cifar_dir, data, labels, message):
    _write(cifar_dir / "cifar-10-batches-py" / "test_batch", data, labels)
    with pytest.raises(ValueError, match=message) as e:
        load_dataset("cifar10", data_dir=str(cifar_dir))
    assert "test_batch" in str(e.value)


def test_cifar_missing_key(cifar_dir):
    with open(cifar_dir / "cifar-10-batches-py" / "data_batch_1", "wb") as f:
        pickle.dump({b"data": _pattern(8, 0)}, f)
    with pytest.raises(ValueError, match="data_batch_1.*labels"):
        load_dataset("cifar10", data_dir=str(cifar_dir))


# ------------------------------------------------------------------------------------------------ synthetic

def test_synthetic_shapes_and_determinism():
    a, b = load_dataset("synthetic", image_size=16, seed=3), load_dataset("synthetic", image_size=16, seed=3)
    assert a.train_x.shape == (2048, 3, 16, 16) and a.test_x.shape == (512, 3, 16, 16)
    assert a.train_x.dtype == torch.uint8 and a.train_y.dtype == torch.int64 and a.num_classes == 10
    assert a.augment == "none" and torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    assert torch.bincount(a.train_y).tolist() == [205] * 8 + [204] * 2
    assert not torch.equal(load_dataset("synthetic", image_size=16, seed=4).train_x, a.train_x)
    # class means differ far more than within-class noise averages out: learnable
    means = torch.stack([a.train_x[a.train_y == k].float().mean(0) for k in range(10)])
    assert (means[0] - means[1]).abs().mean() > 10
    assert load_dataset("synthetic").image_size == 32


# ------------------------------------------------------------------------------------------------ loader

def _tiny(n=50, test=23, size=8, augment="none"):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n + test, 1, size, size), generator=g, dtype=torch.uint8)
    y = torch.arange(n + test) % 10
    return ImageData("tiny", x[:n], y[:n], x[n:], y[n:], 10, (0.5,), (0.25,), augment)


def test_train_shards_disjoint_equal_and_cover():
    data, world = _tiny(n=50), 4
    loaders = [ShardedLoader(data, 4, r, world, seed=1) for r in range(world)]
    shards = [ld.indices().tolist() for ld in loaders]
    assert {len(ld) for ld in loaders} == {3}                       # 50 // 4 = 12 per rank = 3 full batches
    assert all(len(s) == 12 for s in shards)
    flat = sum(shards, [])
    assert len(set(flat)) == len(flat) == (50 // world) * world
    # yielded batches are those indices (no augmentation here), normalised
    for ld, s in zip(loaders, shards):
        xs, ys = zip(*ld.batches())
        assert all(x.shape == (4, 1, 8, 8) and x.dtype == torch.float32 for x in xs)
        assert torch.equal(torch.cat(ys), data.train_y[s])
        assert torch.allclose(torch.cat(xs), (data.train_x[s].float() / 255 - 0.5) / 0.25)


def test_shards_cover_with_batch_dropping(digits):
    loaders = [ShardedLoader(digits, 32, r, 4) for r in range(4)]
    assert {len(ld) for ld in loaders} == {359 // 32}
    flat = torch.cat([ld.indices() for ld in loaders])
    assert len(flat.unique()) == len(flat) == 4 * 11 * 32


def test_epoch_order_and_reproducibility():
    data = _tiny(n=64)
    a, b = ShardedLoader(data, 8, 1, 2, seed=5), ShardedLoader(data, 8, 1, 2, seed=5)
    a.set_epoch(0)
    e0 = a.indices()
    a.set_epoch(1)
    e1 = a.indices()
    b.set_epoch(1)
    assert not torch.equal(e0, e1) and torch.equal(e1, b.indices())
    assert not torch.equal(ShardedLoader(data, 8, 1, 2, seed=6).indices(), e0)


@pytest.mark.parametrize("world", [1, 3])
def test_resume_mid_epoch_identical(digits, world):
    ld = ShardedLoader(digits, 64, world - 1, world, seed=2)
    ld.set_epoch(3)
    full = list(ld.batches())
    k = len(full) // 2
    tail = list(ld.batches(start=k))
    fresh = ShardedLoader(digits, 64, world - 1, world, seed=2)   # a restarted process
    fresh.set_epoch(3)
    resumed = list(fresh.batches(start=k))
    assert len(tail) == len(resumed) == len(full) - k
    for (x, y), (xt, yt), (xr, yr) in zip(full[k:], tail, resumed):
        assert torch.equal(x, xt) and torch.equal(x, xr) and torch.equal(y, yt) and torch.equal(y, yr)
    assert list(ld.batches(start=len(ld))) == []
    with pytest.raises(ValueError, match="start"):
        ld.batches(start=len(ld) + 1)


def test_augmentation_changes_images_keeps_shape_and_normalises(digits):
    ld = ShardedLoader(digits, 128, 0, 1, seed=0)
    plain = ShardedLoader(ImageData(**{**digits.__dict__, "augment": "none"}), 128, 0, 1, seed=0)
    (xa, ya), (xp, yp) = next(ld.batches()), next(plain.batches())
    assert xa.shape == xp.shape == (128, 1, 16, 16) and torch.equal(ya, yp)
    assert not torch.equal(xa, xp)
    same = (xa == xp).flatten(1).all(1)
    assert same.float().mean() < 0.5                    # most samples moved (1/25 stay put by chance)
    allx = torch.cat([x for x, _ in ld.batches()])
    assert abs(allx.mean().item()) < 0.1 and 0.8 < allx.std().item() < 1.2


def test_cifar_augment_flips(cifar_dir):
    data = load_dataset("cifar10", data_dir=str(cifar_dir))
    x, _ = next(ShardedLoader(data, 40, 0, 1, seed=0).batches())
    src = (torch.tensor(data.mean).view(1, 3, 1, 1) + x * torch.tensor(data.std).view(1, 3, 1, 1)) * 255
    # the pattern rises by 1 per column, so along interior columns a kept crop rises and a flipped one falls
    step = src[:, 0, 16, 6:26].diff()
    rising, falling = (step > 0).all(1), (step < 0).all(1)
    assert bool((rising | falling).all()) and rising.any() and falling.any()


def test_eval_shards_cover_once_with_partial_batches():
    data, world = _tiny(test=23), 4
    seen = []
    for r in range(world):
        ld = ShardedLoader(data, 4, r, world, train=False)
        ys = [y for _, y in ld.batches()]
        assert len(ld) == len(ys) == 2                  # 6, 6, 6, 5 samples -> 2 batches each
        assert [len(y) for y in ys][-1] == (2 if r < 3 else 1)
        seen += ld.indices().tolist()
        xs = torch.cat([x for x, _ in ld.batches()])
        assert torch.allclose(xs, (data.test_x[r::world].float() / 255 - 0.5) / 0.25)   # no augmentation
    assert sorted(seen) == list(range(23))


def test_too_small_and_bad_rank():
    with pytest.raises(ValueError, match=r"50 training samples over 4 rank\(s\).*batch_size=16"):
        ShardedLoader(_tiny(n=50), 16, 0, 4)
    with pytest.raises(ValueError, match="rank"):
        ShardedLoader(_tiny(), 4, 4, 4)
    one = ShardedLoader(_tiny(n=50), 16, 0, 1)
    assert len(one) == 3 and one.num_samples == 48
