"""The idx reader shared by the MNIST and Fashion-MNIST loaders."""

import gzip
import struct

import numpy as np
import pytest

import exogym.data.mnist as mnist_module
from exogym.data.idx import IMAGES_MAGIC, LABELS_MAGIC, read_idx


def _idx_bytes(array, magic=None):
    magic = magic if magic is not None else 0x800 + array.ndim
    return struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape) + array.tobytes()


@pytest.mark.parametrize("gz", [True, False], ids=["gzipped", "plain"])
def test_images_and_labels_read_back_exactly(tmp_path, gz):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    labels = np.array([7, 3], dtype=np.uint8)
    for name, array, magic in (("images", images, IMAGES_MAGIC), ("labels", labels, LABELS_MAGIC)):
        path = tmp_path / (name + (".gz" if gz else ""))
        path.write_bytes(gzip.compress(_idx_bytes(array)) if gz else _idx_bytes(array))
        got = read_idx(path, magic)
        assert got.dtype == np.uint8 and np.array_equal(got, array)
        got[...] = 0  # a writable copy, not a view of the file's bytes


def test_a_wrong_magic_number_names_the_file_and_both_numbers(tmp_path):
    path = tmp_path / "t10k-labels-idx1-ubyte"
    path.write_bytes(_idx_bytes(np.zeros((2, 28, 28), dtype=np.uint8)))
    with pytest.raises(RuntimeError, match=r"t10k-labels-idx1-ubyte starts with magic number 0x803, "
                                           r"expected 0x801 \(an idx label file\)"):
        read_idx(path, LABELS_MAGIC)


def test_a_truncated_file_is_reported_with_its_sizes(tmp_path):
    path = tmp_path / "images"
    path.write_bytes(_idx_bytes(np.zeros((2, 28, 28), dtype=np.uint8))[:-5])
    with pytest.raises(RuntimeError, match=r"header says shape \(2, 28, 28\) \(1568 bytes\) but 1563 bytes follow"):
        read_idx(path, IMAGES_MAGIC)


def test_the_mnist_loader_uses_the_shared_reader():
    assert mnist_module.read_idx is read_idx and not hasattr(mnist_module, "_read_idx")
