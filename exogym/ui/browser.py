"""The view served on a thread of this process, and a headless Chromium page to drive it (Playwright with the
system's browser): what the browser tests, the speed benchmark and the screenshot script share.

Playwright's own browser downloads are never used: the browser is Debian's `chromium` (`/usr/bin/chromium`, or
`$EXOGYM_CHROMIUM`), started headless with no network services of its own.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

__all__ = ["served", "headless_page", "chromium_path", "CHROMIUM_FLAGS"]

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_path() -> str | None:
    """The system's Chromium, or None where there is none."""
    path = os.environ.get("EXOGYM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    return path if Path(path).is_file() else None


@contextlib.contextmanager
def served(root: str | os.PathLike, *, token: str | None = None) -> Iterator[tuple[str, str]]:
    """Serve the view of `root` on 127.0.0.1, a free port, on a thread of this process.

    Args:
        root: The folder of runs.
        token: The token (drawn when None).

    Yields:
        (the base address `http://127.0.0.1:PORT`, the token).
    """
    import uvicorn

    from exogym.ui.app import make_app

    token = token or secrets.token_urlsafe(24)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_app(root, token), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the view's server did not start within 30 s")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", token
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextlib.contextmanager
def headless_page(width: int = 1400, height: int = 900) -> Iterator[Any]:
    """A page of headless Chromium (the system's), through Playwright.

    Args:
        width: The viewport's width in CSS pixels.
        height: Its height.

    Yields:
        A Playwright `Page`.

    Raises:
        RuntimeError: No Chromium on this machine (naming how to install it).
    """
    from playwright.sync_api import sync_playwright

    path = chromium_path()
    if path is None:
        raise RuntimeError("no Chromium found: apt-get install -y chromium (or set EXOGYM_CHROMIUM to its path)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            yield page
        finally:
            browser.close()
