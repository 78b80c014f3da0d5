import hashlib
import os
import pickle
import struct

import numpy as np
import pytest
import torch
import torchvision.datasets as tvd

from ps_train.config import DigitsConfig, SyntheticConfig, VisionDataConfig
from ps_train.partition import partition, steps_per_epoch, total_steps
from ps_train.workloads.vision.data import (
    BatchIterator,
    DatasetNotFoundError,
    TensorSplit,
    iter_eval_batches,
    load_data,
    prepare_data,
)

# ---------------------------------------------------------------- real-format fixtures


def _write_idx(path, array: np.ndarray) -> None:
    # idx format: big-endian magic (0x00, 0x00, dtype 0x08 = ubyte, ndim), big-endian dims, data.
    with open(path, "wb") as f:
        f.write(bytes([0, 0, 0x08, array.ndim]))
        f.write(struct.pack(">" + "I" * array.ndim, *array.shape))
        f.write(array.astype(np.uint8).tobytes())


def make_mnist_files(root, folder="MNIST", n_train=12, n_test=5, seed=0):
    rng = np.random.default_rng(seed)
    raw = os.path.join(root, folder, "raw")
    os.makedirs(raw)
    arrays = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        _write_idx(os.path.join(raw, f"{split}-images-idx3-ubyte"), images)
        _write_idx(os.path.join(raw, f"{split}-labels-idx1-ubyte"), labels)
        arrays[split] = (images, labels)
    return arrays


def make_cifar_files(root, per_batch=3, seed=0):
    """CIFAR-10 python batches: dict with b"data" [N, 3072] uint8 (R, G, B planes) and labels."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder)
    written = {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        entry = {
            "batch_label": name,
            "data": rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8),
            "labels": rng.integers(0, 10, size=per_batch).tolist(),
            "filenames": [f"{name}_{i}.png" for i in range(per_batch)],
        }
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(entry, f)
        written[name] = entry
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump(
            {
                "label_names": [
                    "airplane",
                    "automobile",
                    "bird",
                    "cat",
                    "deer",
                    "dog",
                    "frog",
                    "horse",
                    "ship",
                    "truck",
                ],
                "num_vis": 3072,
            },
            f,
        )
    return folder, written


def _md5(path):
    return hashlib.md5(open(path, "rb").read()).hexdigest()


def trust_generated_cifar(monkeypatch, folder):
    """torchvision checks every CIFAR file against the md5 of the real release. Our files are
    generated, so point the expected checksums at them (the check itself still runs)."""
    cls = tvd.CIFAR10
    monkeypatch.setattr(cls, "train_list", [[n, _md5(os.path.join(folder, n))] for n, _ in cls.train_list])
    monkeypatch.setattr(cls, "test_list", [[n, _md5(os.path.join(folder, n))] for n, _ in cls.test_list])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": _md5(os.path.join(folder, cls.meta["filename"]))})


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "name,folder,mean,std", [("mnist", "MNIST", 0.1307, 0.3081), ("fashion_mnist", "FashionMNIST", 0.2860, 0.3530)]
)
def test_mnist_family_loads_through_torchvision(tmp_path, name, folder, mean, std):
    arrays = make_mnist_files(tmp_path, folder)
    train, test = load_data(VisionDataConfig(name=name, root=str(tmp_path)))
    for split, (images, labels) in ((train, arrays["train"]), (test, arrays["t10k"])):
        assert len(split) == len(labels) and split.in_shape == (1, 28, 28) == VisionDataConfig(name=name).sample_shape()
        assert split.images.dtype == torch.uint8  # stored compactly, normalised per batch
        x, y = split[:]
        assert x.dtype == torch.float32 and x.shape == (len(labels), 1, 28, 28)
        expected = (torch.from_numpy(images).float() / 255 - mean) / std
        torch.testing.assert_close(x[:, 0], expected)
        assert torch.equal(y, torch.from_numpy(labels).long())


def test_cifar10_loads_through_torchvision_with_checksums(tmp_path, monkeypatch):
    folder, written = make_cifar_files(tmp_path)
    trust_generated_cifar(monkeypatch, folder)
    train, test = load_data(VisionDataConfig(name="cifar10", root=str(tmp_path)))
    assert len(train) == 15 and len(test) == 3 and train.in_shape == (3, 32, 32)
    # Sample 4 of the train set is data_batch_2's row 1: R, G, B planes of 32x32 each.
    row = written["data_batch_2"]["data"][1]
    assert torch.equal(train.images[4], torch.from_numpy(row.reshape(3, 32, 32)))
    assert int(train.labels[4]) == written["data_batch_2"]["labels"][1]
    x, _ = train[4]
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
    torch.testing.assert_close(x, (torch.from_numpy(row.reshape(3, 32, 32)).float() / 255 - mean) / std)
    assert test.labels.tolist() == written["test_batch"]["labels"]


def test_cifar10_with_wrong_checksums_is_reported(tmp_path):
    make_cifar_files(tmp_path)  # not the real release: torchvision's md5 check fails
    with pytest.raises(
        DatasetNotFoundError,
        match=r"could not load the files in "
        r".*cifar-10-batches-py.*data.download=true",
    ):
        load_data(VisionDataConfig(name="cifar10", root=str(tmp_path)))


@pytest.mark.parametrize(
    "name,where", [("mnist", "MNIST/raw"), ("fashion_mnist", "FashionMNIST/raw"), ("cifar10", "cifar-10-batches-py")]
)
def test_missing_files_say_where_and_how(tmp_path, name, where):
    with pytest.raises(DatasetNotFoundError) as info:
        load_data(VisionDataConfig(name=name, root=str(tmp_path)))
    msg = str(info.value)
    assert os.path.join(str(tmp_path), where) in msg
    assert "data.download=true" in msg and "missing:" in msg


def test_digits_split_is_fixed_stratified_and_normalised():
    train, test = load_data(DigitsConfig())
    assert (len(train), len(test)) == (1437, 360) and train.in_shape == (1, 8, 8)
    x, y = train[:]
    assert abs(x.mean().item()) < 1e-4 and abs(x.std().item() - 1) < 1e-3
    assert torch.bincount(test.labels, minlength=10).min() >= 34  # stratified: ~36 per class
    again, _ = load_data(DigitsConfig())
    assert torch.equal(again.images, train.images)
    other, _ = load_data(DigitsConfig(split_seed=1))
    assert not torch.equal(other.images, train.images)
    # The two splits are disjoint and together hold all 1797 images.
    rows = {tuple(r.tolist()) for r in torch.cat([train.images, test.images]).view(-1, 64)}
    assert len(rows) >= 1790  # a handful of digits are exact duplicates in the original data


def test_synthetic_is_seeded_and_shaped():
    cfg = SyntheticConfig(shape=[3, 8, 8], num_classes=4, train_size=40, test_size=8, data_seed=3)
    train, test = load_data(cfg)
    assert train.images.shape == (40, 3, 8, 8) and len(test) == 8 and train.num_classes == cfg.class_count() == 4
    assert torch.equal(load_data(cfg)[0].images, train.images)
    assert not torch.equal(
        load_data(SyntheticConfig(shape=[3, 8, 8], num_classes=4, train_size=40, test_size=8, data_seed=4))[0].images,
        train.images,
    )
    flat, _ = load_data(SyntheticConfig(shape=[20], train_size=5, test_size=5))
    assert flat[0:2][0].shape == (2, 20)


@pytest.mark.parametrize(
    "cfg", [SyntheticConfig(shape=[3, 8, 8], num_classes=4, train_size=40, test_size=8, data_seed=3), DigitsConfig()]
)
def test_prepared_data_is_what_each_trainer_would_draw(cfg, monkeypatch):
    # The fork server draws computed data once (prepare_data); every trainer's load_data must
    # then return exactly the samples it would have drawn itself, and only for that config.
    import ps_train.workloads.vision.data as data

    monkeypatch.setattr(data, "_PREPARED", {})
    own_train, own_test = load_data(cfg)
    prepare_data(cfg)
    train, test = load_data(cfg)
    assert load_data(cfg)[0] is train  # taken, not drawn again
    assert torch.equal(train.images, own_train.images) and torch.equal(train.labels, own_train.labels)
    assert torch.equal(test.images, own_test.images) and torch.equal(test.labels, own_test.labels)
    assert torch.equal(train[0:5][0], own_train[0:5][0])  # normalised the same way
    if isinstance(cfg, SyntheticConfig):
        other = SyntheticConfig(shape=[3, 8, 8], num_classes=4, train_size=40, test_size=8, data_seed=4)
        assert not torch.equal(load_data(other)[0].images, train.images)


def test_files_are_not_prepared(monkeypatch, tmp_path):
    import ps_train.workloads.vision.data as data

    monkeypatch.setattr(data, "_PREPARED", {})
    prepare_data(VisionDataConfig(name="mnist", root=str(tmp_path)))  # read from files by each trainer
    assert data._PREPARED == {}


@pytest.mark.parametrize("n,world", [(103, 3), (10, 1), (7, 4), (0, 2)])
def test_partition_is_disjoint_covering_balanced_and_deterministic(n, world):
    parts = [partition(n, r, world, seed=11, epoch=2) for r in range(world)]
    merged = torch.cat(parts)
    assert sorted(merged.tolist()) == list(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert all(torch.equal(p, partition(n, r, world, 11, 2)) for r, p in enumerate(parts))


def test_partition_changes_with_epoch_and_seed_and_checks_rank():
    base = partition(100, 0, 2, seed=0, epoch=0)
    assert not torch.equal(base, partition(100, 0, 2, seed=0, epoch=1))
    assert not torch.equal(base, partition(100, 0, 2, seed=1, epoch=0))
    with pytest.raises(ValueError, match="rank 2 must be in"):
        partition(100, 2, 2, 0, 0)


def _split(n=50):
    return TensorSplit(torch.arange(n, dtype=torch.float32).view(n, 1), torch.arange(n) % 3, 3)


def test_batch_iterator_walks_own_partition_epoch_by_epoch():
    data = _split(50)
    its = [BatchIterator(data, r, 3, batch_size=4, seed=7) for r in range(3)]
    assert its[0].steps_per_epoch == steps_per_epoch(50, 3, 4) == 4  # 16 samples each -> 4 batches
    for epoch in range(2):
        seen = []
        for it in its:
            own = set(partition(50, it.rank, 3, 7, epoch).tolist())
            for _ in range(4):
                x, y = next(it)
                ids = x.view(-1).long().tolist()
                assert set(ids) <= own and torch.equal(y, torch.tensor(ids) % 3)
                seen += ids
        assert len(seen) == len(set(seen)) == 48  # disjoint across trainers
        assert all(it.state_dict()["epoch"] == epoch for it in its)
    next(its[0])
    assert (its[0].epoch, its[0].offset) == (2, 4)


def test_batch_iterator_resumes_exactly_across_epochs():
    data = _split(50)
    ref = BatchIterator(data, 1, 2, batch_size=6, seed=3)
    for _ in range(5):
        next(ref)
    state = ref.state_dict()
    expected = [next(ref)[0] for _ in range(9)]  # crosses the 4-batch epoch boundary twice
    resumed = BatchIterator(data, 1, 2, batch_size=6, seed=3)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, next(resumed)[0]) for a in expected)


def test_batch_iterator_errors():
    data = _split(10)
    with pytest.raises(ValueError, match=r"train.batch_size=8: each of the 2 trainers gets only 5"):
        BatchIterator(data, 0, 2, batch_size=8, seed=0)
    it = BatchIterator(data, 0, 2, batch_size=2, seed=0)
    with pytest.raises(ValueError, match="world=3 into a trainer with world=2"):
        it.load_state_dict({"epoch": 0, "offset": 2, "rank": 0, "world": 3, "seed": 0})


def test_eval_batches_cover_all_in_order_and_total_steps():
    data = _split(11)
    xs = [x for x, _ in iter_eval_batches(data, 4)]
    assert [len(x) for x in xs] == [4, 4, 3] and torch.cat(xs).view(-1).tolist() == list(range(11))
    assert total_steps(None, 3, 1437, 2, 32) == 3 * 22
    assert total_steps(100, None, 1437, 2, 32) == 100
