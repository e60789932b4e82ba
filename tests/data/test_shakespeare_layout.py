"""`exogym data shakespeare --original-layout DIR`: the files the original EXO Gym's nanoGPT scripts read, in its
vocabulary and layout (records ending with id 65), for its splits."""

import numpy as np
import pytest

import exogym.data.shakespeare as shakespeare
from exogym.cli.commands import main
from exogym.data.shakespeare_layout import (ORIGINAL_SPLITS, ORIGINAL_VOCAB, original_file, original_ids,
                                            write_original_layout)

TEXT = "A:\nTo be.\n\nB:\nNot \"so\"—9 times.\n\nC:\nYes.\n\nD:\nNo.\n"


def test_records_in_the_originals_vocabulary_each_ending_with_65():
    assert len(ORIGINAL_VOCAB) == 65
    ids = original_ids(TEXT, 0.0, 1.0)
    assert ids.dtype == np.int64 and ids.ndim == 1
    records = np.split(ids, np.flatnonzero(ids == 65) + 1)[:-1]
    decoded = ["".join(ORIGINAL_VOCAB[i] for i in r[:-1]) for r in records]
    assert decoded == ["A:\nTo be.", "B:\nNot 'so'- times.", "C:\nYes.", "D:\nNo."]  # replaced, dropped
    assert "".join(ORIGINAL_VOCAB[i] for i in original_ids(TEXT, 0.5, 0.75)[:-1]) == "C:\nYes."  # int(records x pc)
    with pytest.raises(ValueError, match="start_pc must be below end_pc, got 0.9 and 0.5"):
        original_ids(TEXT, 0.9, 0.5)


def test_the_command_writes_what_the_scripts_read_and_keeps_what_is_there(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shakespeare, "shakespeare_text", lambda **kw: TEXT * 50)
    assert main(["data", "shakespeare", "--original-layout", str(tmp_path), "--block-size", "64", "--quiet"]) == 0
    out = capsys.readouterr().out
    names = sorted(p.name for p in (tmp_path / "data" / "shakespeare_char").iterdir())
    assert names == sorted(f"data_block64_{a}_{b}.npy" for a, b in ORIGINAL_SPLITS)  # the scripts' own spelling
    assert "data_block64_0.0_0.9.npy" in out and "data_block64_0.99_1.0.npy" in out
    train = np.load(original_file(tmp_path, 64, 0.0, 0.9))
    assert np.array_equal(train, original_ids(TEXT * 50, 0.0, 0.9)) and train.max() == 65
    write_original_layout(tmp_path, block_sizes=[64])  # the same ids: kept, no error
    path = original_file(tmp_path, 64, 0.9, 1.0)
    np.save(path, np.arange(3))
    assert main(["data", "shakespeare", "--original-layout", str(tmp_path), "--block-size", "64", "--quiet"]) == 2
    assert "exists and holds other ids" in capsys.readouterr().err and np.array_equal(np.load(path), np.arange(3))
