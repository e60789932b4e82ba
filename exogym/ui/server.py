"""`exogym ui`: serve the web view of a folder of runs on 127.0.0.1 with a fresh token, and print its address."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

__all__ = ["serve", "view_address", "INSTALL"]

INSTALL = 'the web view needs the ui extra: pip install "exogym[ui]" (Starlette, uvicorn, plotly)'


def view_address(host: str, port: int, token: str) -> str:
    """The address to open: the page with its token.

    Args:
        host: The address served.
        port: The port.
        token: The token.

    Returns:
        The URL.
    """
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/?token={token}"


def serve(root: str | os.PathLike, *, port: int = 8765, host: str = "127.0.0.1", token: str | None = None) -> None:
    """Serve the web view of `root` until interrupted (Ctrl-C).

    Args:
        root: The folder of run folders and sweep folders.
        port: The port (0: any free one).
        host: The address to bind; 127.0.0.1 by default (only this machine can connect).
        token: The secret the address carries; drawn with `secrets` when None.

    Raises:
        ImportError: The ui extra is not installed (naming it).
        ValueError: `root` is not a folder, or the port is out of range.
    """
    try:
        import uvicorn

        from exogym.ui.app import make_app
    except ImportError as e:
        raise ImportError(f"{INSTALL} ({e})") from e
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {port}")
    if not Path(root).is_dir():
        raise ValueError(f"exogym ui serves a folder of runs; {str(root)!r} is not a folder")
    token = token or secrets.token_urlsafe(24)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))  # bound here, so the address printed is the one served (port 0: the one drawn)
    port = sock.getsockname()[1]
    hosts = ("127.0.0.1", "localhost", "::1") if host in ("127.0.0.1", "localhost", "::1") else (host,)
    app = make_app(root, token, hosts=hosts)
    print(f"exogym ui: serving {str(Path(root).resolve())!r} at {view_address(host, port, token)}", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
