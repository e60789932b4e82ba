"""A checkpoint of an asynchronous run whose bytes were changed and whose sha256 was written again (issue 46): what
the nodes would trust blindly, the messages in flight, the mailboxes, the server's state and the random streams, is
checked against the run, and a field that cannot be this run's is a CheckpointError naming it, never a raw KeyError
or OverflowError deep inside a node, nor silence: a message to node 99, a server tensor of another shape, an arrival
time that is nan or negative, a random stream cut short; and a fuzz of single-byte changes in a file's pickled
structure, each of which loads and resumes, or is a CheckpointError."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import random
import shutil
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import toy
from exogym import Trainer
from exogym.cluster.network import Network
from exogym.runs.checkpoint import CheckpointError, load_checkpoint, read_manifest
from exogym.strategy import AsyncDiLoCoStrategy, GossipStrategy

FIT = dict(progress=False, device="cpu", logger=False, batch_size=8, node_speeds=[1.0, 0.6, 0.3], network="home")
MAKE = {"gossip": lambda: GossipStrategy(topology="ring", mode="async", lr=0.05),  # messages in flight
        "async_diloco": lambda: AsyncDiLoCoStrategy(H=2, lr=1e-2)}  # a server's state


def _fit(name, **kw):
    fit = {**FIT, "network": Network(bandwidth="inf", latency=0.5)} if name == "gossip" else FIT  # no shared links:
    return Trainer(toy.TinyMLP(), toy.make_classification(256)).fit(MAKE[name](), 3, max_steps=8, **fit, **kw)
    # the gossip run's messages in flight have their arrival times


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    for name in MAKE:
        _fit(name, checkpoint_interval=4, checkpoint_dir=root / name)
    return {name: root / name / "step_000000004" for name in MAKE}


def _copy(src: Path, dst: Path, data: bytes | None = None, change=None) -> Path:
    """The checkpoint with node 0's file replaced (its bytes, or its state changed by `change`), its sha256 in the
    manifest written again."""
    shutil.copytree(src, dst)
    if change is not None:
        plain = torch.load(dst / "node0.pt", weights_only=True)
        change(plain)
        buffer = io.BytesIO()
        torch.save(plain, buffer)
        data = buffer.getvalue()
    (dst / "node0.pt").write_bytes(data)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["files"]["node0.pt"]["sha256"] = hashlib.sha256(data).hexdigest()
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _load(folder: Path):
    return load_checkpoint(folder, read_manifest(folder), devices=[torch.device("cpu")] * 3)


def _arriving(plain):
    """The first event that is a message with its arrival time (not one starting on shared links)."""
    events = plain["strategy"]["messages"]["events"]
    return next(i for i, e in enumerate(events) if "message" in e and not e.get("start"))


def _event(plain):
    return plain["strategy"]["messages"]["events"][_arriving(plain)]["message"]


@pytest.mark.parametrize("field, change", [
    ("messages.events[0].message.dst", lambda p: _event(p).update(dst=99)),
    ("messages.events[0].message.arrives_at", lambda p: _event(p).update(arrives_at=math.nan)),
    ("messages.events[0].message.arrives_at", lambda p: _event(p).update(arrives_at=-1.0)),
    ("messages.events[0].message.arrives_at", lambda p: _event(p).update(arrives_at=_event(p)["sent_at"] - 1e-3)),
    ("messages.events[0].message.dst", lambda p: _event(p).update(src=_event(p)["dst"])),
    ("messages.sent", lambda p: p["strategy"]["messages"]["sent"].update({7: 1})),
    ("rng.python", lambda p: p["rng"].update(python=(3, p["rng"]["python"][1][:100], None))),
    ("rng.numpy keys", lambda p: p["rng"]["numpy"].__setitem__(1, p["rng"]["numpy"][1][:10])),
    ("clock.now", lambda p: p["clock"].update(now=-5.0)),
], ids=["node-99", "nan-arrival", "negative-arrival", "arrives-before-sent", "to-itself", "sender-7",
        "python-rng-cut", "numpy-rng-cut", "negative-clock"])
def test_a_changed_field_is_a_checkpoint_error_naming_it(checkpoints, tmp_path, field, change):
    folder = _copy(checkpoints["gossip"], tmp_path / "c", change=change)
    index = _arriving(torch.load(folder / "node0.pt", weights_only=True))
    field = field.replace("events[0]", f"events[{index}]")
    with pytest.raises(CheckpointError, match=rf"node0\.pt'?: {field.replace('[', '.').replace(']', '.')}"):
        _load(folder)


def test_a_server_tensor_of_another_shape_is_a_checkpoint_error_naming_it(checkpoints, tmp_path):
    def grow(plain):
        state = plain["strategy"]["messages"]["server"]["state"]
        state["theta"] = torch.cat([state["theta"], state["theta"][:3]])
    folder = _copy(checkpoints["async_diloco"], tmp_path / "c", change=grow)
    _load(folder)  # the server's shape is known once the run makes it
    with pytest.raises(CheckpointError, match=r"server state\.theta holds \(\d+,\) torch.float32 where this run's "
                                              r"server has a \(\d+,\) torch.float32 tensor"):
        _fit("async_diloco", resume_from=folder)


FUZZ = 30


def test_single_byte_changes_load_and_resume_or_are_checkpoint_errors(checkpoints, tmp_path):
    src = checkpoints["gossip"]
    raw = (src / "node0.pt").read_bytes()
    with zipfile.ZipFile(src / "node0.pt") as z:  # the pickled structure (the tensors' bytes are only values)
        pkl = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    start = pkl.header_offset + 30 + len(pkl.filename.encode()) + len(pkl.extra)
    draw, outcomes = random.Random(46), []
    for n in range(FUZZ):
        data = bytearray(raw)
        pos = draw.randrange(start, start + pkl.file_size)
        data[pos] = (data[pos] + draw.randrange(1, 256)) % 256
        folder = _copy(src, tmp_path / f"c{n}", data=bytes(data))
        try:
            _load(folder)
            with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                _fit("gossip", resume_from=folder)
            outcomes.append("resumed")
        except CheckpointError:
            outcomes.append("refused")
        except Exception as e:  # noqa: BLE001 - the point: nothing else
            pytest.fail(f"byte {pos} changed: {type(e).__name__}: {e}")
    assert "refused" in outcomes
