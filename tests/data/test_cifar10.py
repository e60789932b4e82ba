"""The CIFAR-10 reader on a small folder in the `cifar-10-batches-py` format, written by the tests."""

import os
import pickle

import numpy as np
import pytest
import torch

from exogym.data.cifar10 import CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD, load_cifar10

TRAIN_SIZES = (3, 2, 1, 2, 2)  # images in data_batch_1 .. data_batch_5 (10,000 each in the real files)


def _batch(n, offset):
    """A batch as CIFAR stores it: rows of 3072 bytes (1024 red, 1024 green, 1024 blue), labels as a list."""
    data = np.random.default_rng(offset).integers(0, 256, size=(n, 3072), dtype=np.uint8)
    return {b"batch_label": b"a batch", b"data": data, b"labels": [(offset + i) % 10 for i in range(n)],
            b"filenames": [b"x.png"] * n}


@pytest.fixture
def cifar(tmp_path):
    """tmp_path/cifar-10-batches-py with five train batches and a test batch; returns (folder, batches)."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    batches = {f"data_batch_{i + 1}": _batch(n, 7 * i) for i, n in enumerate(TRAIN_SIZES)}
    batches["test_batch"] = _batch(4, 100)
    for i, (name, batch) in enumerate(batches.items()):
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2 if i % 2 else pickle.HIGHEST_PROTOCOL)  # both kinds of numpy pickle
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [c.encode() for c in CIFAR10_CLASSES]}, f, protocol=2)
    return folder, batches


def test_train_is_the_five_batches_in_order_and_exact(cifar):
    folder, batches = cifar
    images, labels = load_cifar10(folder, "train", normalize=False).tensors
    assert images.shape == (sum(TRAIN_SIZES), 3, 32, 32) and images.dtype == torch.float32
    assert labels.dtype == torch.int64
    rows = np.concatenate([batches[f"data_batch_{i}"][b"data"] for i in range(1, 6)])
    assert torch.equal(images.flatten(1) * 255, torch.from_numpy(rows).float())
    assert labels.tolist() == sum((batches[f"data_batch_{i}"][b"labels"] for i in range(1, 6)), [])


def test_channels_are_red_green_blue_planes_row_by_row(cifar):
    folder, batches = cifar
    images = load_cifar10(folder, "test", normalize=False).tensors[0]
    row = batches["test_batch"][b"data"][1]
    pixels = (images[1] * 255).round().to(torch.uint8)  # [3, 32, 32]
    assert len({row[1024 * c: 1024 * (c + 1)].tobytes() for c in range(3)}) == 3  # distinct planes: order matters
    assert torch.equal(pixels, torch.from_numpy(row).view(3, 32, 32))
    assert pixels[0, 0, 0] == row[0]  # red, top left
    assert pixels[1, 0, 1] == row[1024 + 1]  # green, second pixel of the first row
    assert pixels[2, 1, 0] == row[2048 + 32]  # blue, first pixel of the second row


def test_normalize_uses_the_per_channel_train_statistics(cifar):
    folder, _ = cifar
    raw = load_cifar10(folder, "test", normalize=False).tensors[0]
    images, labels = load_cifar10(folder, "test").tensors
    for c in range(3):
        assert torch.allclose(images[:, c], (raw[:, c] - CIFAR10_MEAN[c]) / CIFAR10_STD[c])
    assert labels.tolist() == [0, 1, 2, 3]


def test_the_folder_holding_cifar_10_batches_py_is_accepted(cifar):
    folder, _ = cifar
    assert len(load_cifar10(folder.parent, "test")) == 4
    assert len(load_cifar10(str(folder), "test")) == 4


def test_a_missing_path_says_where_to_get_the_data(tmp_path):
    with pytest.raises(RuntimeError) as e:
        load_cifar10(tmp_path / "nowhere")
    message = str(e.value)
    assert f"{tmp_path / 'nowhere'} does not exist" in message
    assert "https://www.cs.toronto.edu/~kriz/cifar.html" in message and "tar xzf cifar-10-python.tar.gz" in message


def test_a_folder_without_batches_is_named(tmp_path):
    with pytest.raises(RuntimeError, match="holds no data_batch_1 or test_batch"):
        load_cifar10(tmp_path)


def test_a_missing_batch_file_is_named(cifar):
    folder, _ = cifar
    (folder / "data_batch_4").unlink()
    with pytest.raises(RuntimeError, match=r"data_batch_4 is missing \(a complete cifar-10-batches-py has"):
        load_cifar10(folder, "train")
    assert len(load_cifar10(folder, "test")) == 4  # the test split does not need it


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_pickle_that_would_run_code_is_refused(cifar, tmp_path):
    folder, _ = cifar
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": _Exploit(), b"labels": []}, f)
    with pytest.raises(RuntimeError, match=r"test_batch is not a CIFAR-10 batch file \(refusing to load "
                                           r"(posix|nt)\.system"):
        load_cifar10(folder, "test")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("batch, problem", [
    ({b"data": np.zeros((2, 3072), np.uint8)}, r"expected a dict with b'data' and b'labels', got \[b'data'\]"),
    ({b"data": np.zeros((2, 1024), np.uint8), b"labels": [0, 1]},
     r"b'data' must be uint8 \[n, 3072\], got uint8 \[2, 1024\]"),
    ({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, r"b'data' must be uint8 \[n, 3072\], got float32"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, r"b'labels' must be 2 ints in 0-9"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, r"b'labels' must be 2 ints in 0-9"),
], ids=["no labels", "short rows", "float data", "too few labels", "label 10"])
def test_a_malformed_batch_is_reported(cifar, batch, problem):
    folder, _ = cifar
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(batch, f)
    with pytest.raises(RuntimeError, match=problem):
        load_cifar10(folder, "test")


def test_a_file_that_is_not_a_pickle_is_reported(cifar):
    folder, _ = cifar
    (folder / "test_batch").write_bytes(b"")
    with pytest.raises(RuntimeError, match="test_batch is not a CIFAR-10 batch file"):
        load_cifar10(folder, "test")


def test_an_unknown_split_lists_the_choices(cifar):
    with pytest.raises(ValueError, match=r"split must be one of \['train', 'test'\], got 'val'"):
        load_cifar10(cifar[0], "val")
