"""The Fashion-MNIST loader on Debian's files (where dataset-fashion-mnist is installed) and on files tests write."""

import gzip
import struct

import numpy as np
import pytest
import torch

from exogym.data.fashion_mnist import (DEBIAN_FASHION_MNIST, FASHION_MNIST_CLASSES, FASHION_MNIST_MEAN,
                                       FASHION_MNIST_STD, load_fashion_mnist)


# ---- the real images (Debian's package) ----

@pytest.fixture(scope="module")
def real():
    if not DEBIAN_FASHION_MNIST.is_dir():
        pytest.skip(f"Debian's dataset-fashion-mnist is not installed ({DEBIAN_FASHION_MNIST} is missing; "
                    "apt-get install -y dataset-fashion-mnist)")
    return load_fashion_mnist("train", normalize=False), load_fashion_mnist("test", normalize=False)


def test_real_sizes_shapes_dtypes_and_balanced_classes(real):
    for ds, n in zip(real, (60000, 10000)):
        images, labels = ds.tensors
        assert images.shape == (n, 1, 28, 28) and images.dtype == torch.float32
        assert labels.shape == (n,) and labels.dtype == torch.int64
        assert torch.bincount(labels).tolist() == [n // 10] * 10


def test_real_train_pixels_have_the_published_mean_and_std(real):
    images = real[0].tensors[0].double()
    assert round(images.mean().item(), 4) == 0.2860
    assert round(images.std().item(), 4) == 0.3530


def test_real_first_labels_match_the_original_files(real):
    train, test = real
    assert train.tensors[1][:5].tolist() == [9, 0, 0, 3, 0]  # ankle boot, three T-shirts/tops, a dress
    assert test.tensors[1][:5].tolist() == [9, 2, 1, 1, 6]
    assert FASHION_MNIST_CLASSES[9] == "Ankle boot" and len(FASHION_MNIST_CLASSES) == 10


def test_real_pixels_are_exact_multiples_of_one_255th(real):
    images = real[1].tensors[0]
    assert torch.equal(images, (images * 255).round() / 255)
    assert images.min().item() == 0 and images.max().item() == 1


def test_real_normalized_is_standardised_with_the_train_statistics(real):
    images = load_fashion_mnist("test").tensors[0]
    assert torch.allclose(images, (real[1].tensors[0] - FASHION_MNIST_MEAN) / FASHION_MNIST_STD)


# ---- files the tests write ----

def _write_idx(path, array, gz):
    header = struct.pack(">I", 0x800 + array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def _write_files(folder, *, gz=True, n_test_labels=2):
    suffix = ".gz" if gz else ""
    images = {"train": np.arange(3 * 784).reshape(3, 28, 28) % 256,
              "t10k": 255 - np.arange(2 * 784).reshape(2, 28, 28) % 256}
    labels = {"train": np.array([9, 0, 3]), "t10k": np.array([7, 1, 2][:n_test_labels])}
    for prefix in ("train", "t10k"):
        _write_idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", images[prefix], gz)
        _write_idx(folder / f"{prefix}-labels-idx1-ubyte{suffix}", labels[prefix], gz)
    return images, labels


@pytest.mark.parametrize("gz", [True, False], ids=["gzipped", "plain"])
def test_a_folder_of_idx_files_loads_exactly(tmp_path, gz):
    images, labels = _write_files(tmp_path, gz=gz)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        x, y = load_fashion_mnist(split, root=tmp_path, normalize=False).tensors
        assert x.shape == (len(labels[prefix]), 1, 28, 28)
        assert torch.equal(x[:, 0] * 255, torch.from_numpy(images[prefix]).float())
        assert y.tolist() == labels[prefix].tolist()
    x = load_fashion_mnist("test", root=tmp_path).tensors[0]
    expected = (torch.from_numpy(images["t10k"]).float() / 255 - FASHION_MNIST_MEAN) / FASHION_MNIST_STD
    assert torch.allclose(x[:, 0], expected)


def test_a_missing_folder_says_how_to_install_the_data(tmp_path):
    with pytest.raises(RuntimeError) as e:
        load_fashion_mnist("train", root=tmp_path / "nowhere")
    message = str(e.value)
    assert "train-images-idx3-ubyte[.gz] is not in" in message and str(tmp_path / "nowhere") in message
    assert "apt-get install -y dataset-fashion-mnist" in message and "root=" in message


def test_images_and_labels_that_disagree_are_reported(tmp_path):
    _write_files(tmp_path, n_test_labels=3)
    with pytest.raises(RuntimeError, match="the test idx files hold 2 images but 3 labels"):
        load_fashion_mnist("test", root=tmp_path)


def test_an_unknown_split_lists_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"split must be one of \['train', 'test'\], got 'val'"):
        load_fashion_mnist("val", root=tmp_path)
