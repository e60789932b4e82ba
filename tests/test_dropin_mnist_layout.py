"""`exogym data mnist --torchvision-root DIR` writes the bundled MNIST as torchvision's raw files: the names
torchvision.datasets.MNIST checks for under DIR/MNIST/raw (uncompressed), each an idx file (big-endian magic
0x00000803 / 0x00000801, then the sizes, then uint8 data), read back here by a reader written from the format."""

import struct

import numpy as np
import pytest

import exogym.data._fetch as fetch_module
from exogym.cli.commands import main
from exogym.data.mnist import load_mnist, write_torchvision_layout

NAMES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


@pytest.fixture
def source(tmp_path, monkeypatch):
    """A data root holding a tiny MNIST (3 training and 2 test digits) in the loader's cache; pip must not run."""
    monkeypatch.setattr(fetch_module.subprocess, "run", lambda *a, **k: pytest.fail("pip must not run here"))
    rng = np.random.default_rng(0)
    arrays = {"train_images": rng.integers(0, 256, (3, 28, 28), dtype=np.uint8),
              "train_labels": np.array([5, 0, 4], dtype=np.uint8),
              "test_images": rng.integers(0, 256, (2, 28, 28), dtype=np.uint8),
              "test_labels": np.array([7, 2], dtype=np.uint8)}
    (tmp_path / "src" / "mnist").mkdir(parents=True)
    np.savez(tmp_path / "src" / "mnist" / "mnist_uint8.npz", **arrays)
    return tmp_path / "src", arrays


def _read_as_torchvision_does(path):
    """Magic: 2 zero bytes, a type byte (0x08: unsigned byte), the number of dimensions; then one big-endian int32
    per dimension; then the data, row-major."""
    data = path.read_bytes()
    zero, kind, dims = struct.unpack(">HBB", data[:4])
    assert zero == 0 and kind == 0x08
    shape = struct.unpack(f">{dims}I", data[4:4 + 4 * dims])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims)
    assert body.size == int(np.prod(shape))
    return body.reshape(shape)


def test_the_files_are_torchvisions_names_and_format(source, tmp_path):
    root, arrays = source
    paths = write_torchvision_layout(tmp_path / "data", root=root, progress=False)
    raw = tmp_path / "data" / "MNIST" / "raw"
    assert paths == [raw / n for n in NAMES] and sorted(p.name for p in raw.iterdir()) == sorted(NAMES)
    got = {n: _read_as_torchvision_does(raw / n) for n in NAMES}
    assert np.array_equal(got["train-images-idx3-ubyte"], arrays["train_images"])
    assert np.array_equal(got["train-labels-idx1-ubyte"], arrays["train_labels"])
    assert np.array_equal(got["t10k-images-idx3-ubyte"], arrays["test_images"])
    assert np.array_equal(got["t10k-labels-idx1-ubyte"], arrays["test_labels"])
    assert (raw / "train-images-idx3-ubyte").read_bytes()[:8] == bytes.fromhex("00000803 00000003")
    # exogym's own loader reads the folder back as the same digits (its idx source is this layout)
    images, labels = load_mnist("test", root=tmp_path / "data", normalize=False, download=False).tensors
    assert labels.tolist() == [7, 2] and np.array_equal((images[:, 0] * 255).round().byte().numpy(),
                                                          arrays["test_images"])


def test_torchvision_finds_them_and_downloads_nothing(source, tmp_path, monkeypatch):
    datasets = pytest.importorskip("torchvision.datasets", reason="torchvision is not installed")
    import torchvision.datasets.mnist as tv_mnist

    root, arrays = source
    write_torchvision_layout(tmp_path / "data", root=root, progress=False)
    monkeypatch.setattr(tv_mnist, "download_and_extract_archive",
                        lambda *a, **k: pytest.fail("torchvision tried to download"))
    train = datasets.MNIST(str(tmp_path / "data"), True, download=True)
    assert len(train) == 3 and train.targets.tolist() == [5, 0, 4]
    assert np.array_equal(train.data.numpy(), arrays["train_images"])


def test_the_command_writes_them_once_and_never_replaces_other_files(source, tmp_path, capsys, monkeypatch):
    root, _ = source
    monkeypatch.chdir(tmp_path)
    assert main(["data", "mnist", "--torchvision-root", "data", "--data-root", str(root), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "data/MNIST/raw/train-images-idx3-ubyte" in out and "MNIST('data', download=True)" in out
    raw = tmp_path / "data" / "MNIST" / "raw"
    mtimes = {p.name: p.stat().st_mtime_ns for p in raw.iterdir()}
    assert main(["data", "mnist", "--torchvision-root", "data", "--data-root", str(root), "--quiet"]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in raw.iterdir()} == mtimes  # the same digits: left alone
    (raw / "t10k-labels-idx1-ubyte").write_bytes(b"not mnist")
    assert main(["data", "mnist", "--torchvision-root", "data", "--data-root", str(root), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "t10k-labels-idx1-ubyte exists and holds other data than MNIST's" in err and err.count("\n") == 1
    assert (raw / "t10k-labels-idx1-ubyte").read_bytes() == b"not mnist"
