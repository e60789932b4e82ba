"""The web view's server: a Starlette app over one root folder, every request checked for the token.

Routes (all GET, all read-only):

- `/`: the page (exogym/ui/static/index.html); `/static/<file>`: its scripts and style, and plotly.min.js from
  the plotly package (nothing is fetched from the internet).
- `/api/runs`: the runs list and the sweeps; `/api/run?name=`: one run's config, summary, rows (from `since`),
  updates and the call that reruns it; `/api/timeline?name=`: its timeline.json; `/api/sweep?name=`: a sweep's
  table and the commands for it.

Security: a request without the token (query `token=` or header `X-Exogym-Token`) is refused with 403, compared
in constant time; a request whose Host is not the address served is refused (a page elsewhere cannot reach the
view by renaming itself, DNS rebinding); a name is resolved inside the root or refused (exogym.ui.catalog
`resolve_inside`); no route starts a process or writes a file, and any method but GET and HEAD is refused.
"""

from __future__ import annotations

import hmac
import re
import os
import time
from pathlib import Path
from typing import Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from exogym.runs.timeline import TIMELINE_FILE
from exogym.ui.catalog import (UnsafePath, find_folders, read_json, resolve_inside, run_entry, run_rows,
                               sweep_entry)
from exogym.ui.reproduce import rerun_call, sweep_command

__all__ = ["make_app", "STATIC"]

STATIC = Path(__file__).resolve().parent / "static"
_ASSETS = {"app.js": "text/javascript", "timeline.js": "text/javascript", "style.css": "text/css"}


def _plotly_js() -> Path:
    import plotly
    return Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"


def make_app(root: str | os.PathLike, token: str, *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> "_Guard":
    """The web view's ASGI app over `root`.

    Args:
        root: The folder whose run and sweep folders are served.
        token: The secret every request must carry.
        hosts: The host names a request's Host header may name (with any port).

    Returns:
        The Starlette app.

    Raises:
        ValueError: `root` is not a folder, or the token is not 16 or more URL-safe characters.
    """
    root = Path(root).resolve()
    if not root.is_dir():
        raise ValueError(f"exogym ui serves a folder of runs; {str(root)!r} is not a folder")
    if not isinstance(token, str) or not re.fullmatch(r"[A-Za-z0-9_-]{16,}", token):
        raise ValueError("the token must be at least 16 letters, digits, '-' or '_' (exogym ui draws one with "
                         f"secrets), got {token!r}")

    def _named(request: Request) -> Path:
        return resolve_inside(root, request.query_params.get("name", ""))

    page = (STATIC / "index.html").read_text().replace("__TOKEN__", token)  # its scripts' addresses carry the token

    async def index(request: Request) -> Response:
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    async def static(request: Request) -> Response:
        name = request.path_params["file"]
        if name == "plotly.min.js":
            return FileResponse(_plotly_js(), media_type="text/javascript",
                                headers={"Cache-Control": "private, max-age=86400"})
        if name not in _ASSETS:  # a fixed list: no path is ever built from the request
            return PlainTextResponse("no such file", status_code=404)
        return FileResponse(STATIC / name, media_type=_ASSETS[name], headers={"Cache-Control": "no-cache"})

    async def runs(request: Request) -> Response:
        t0 = time.perf_counter()
        found = list(find_folders(root))
        entries = [run_entry(root, name) for kind, name in found if kind == "run"]
        sweeps = [name for kind, name in found if kind == "sweep"]
        return JSONResponse({"root": str(root), "runs": entries, "sweeps": sweeps,
                             "read_s": round(time.perf_counter() - t0, 4)})

    async def run(request: Request) -> Response:
        folder = _named(request)
        if not folder.is_dir():
            return JSONResponse({"error": "no such run folder"}, status_code=404)
        name = folder.relative_to(root).as_posix()
        since_train = int(request.query_params.get("since", "0") or 0)
        since_val = int(request.query_params.get("since_val", "0") or 0)
        config, summary = read_json(folder / "config.json"), read_json(folder / "summary.json")
        summary.pop("comm_per_node", None)
        entry = run_entry(root, name)
        log_dir = (Path(root.name) / Path(name).parent).as_posix()
        rerun = rerun_call(config, summary, log_dir) if config else None
        if entry["sweep"] is not None:  # the sweep reruns its own runs: its resume comes first
            sweep_folder = (Path(root.name) / entry["sweep"]).as_posix()
            rerun = f"# a run of the sweep {sweep_folder}:\n{sweep_command(sweep_folder)}\n\n{rerun or ''}"
        return JSONResponse({"entry": entry, "config": config, "summary": summary,
                             "train": run_rows(folder, "train", since_train), "val": run_rows(folder, "val", since_val),
                             "since": since_train, "since_val": since_val,
                             "rerun": rerun})

    async def timeline(request: Request) -> Response:
        path = _named(request) / TIMELINE_FILE
        if not path.is_file():
            why = ("this run has no timeline: it ran without simulated time (fit's network=), or has not completed "
                   "(one that failed or was stopped has none until a resume completes it)")
            return JSONResponse({"error": why}, status_code=404)
        return FileResponse(path, media_type="application/json", headers={"Cache-Control": "no-cache"})

    async def sweep(request: Request) -> Response:
        folder = _named(request)
        if not (folder / "sweep.json").is_file():
            return JSONResponse({"error": "no such sweep folder"}, status_code=404)
        name = folder.relative_to(root).as_posix()
        return JSONResponse({**sweep_entry(root, name), "commands": sweep_command((Path(root.name) / name).as_posix())})

    async def refused(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": str(exc)}, status_code=403 if isinstance(exc, UnsafePath) else 400)

    app = Starlette(exception_handlers={UnsafePath: refused, ValueError: refused}, routes=[
        Route("/", index), Route("/static/{file}", static), Route("/api/runs", runs), Route("/api/run", run),
        Route("/api/timeline", timeline), Route("/api/sweep", sweep)])
    return _Guard(app, token, {h.lower() for h in hosts})


_HEADERS = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"),  # the token never leaves
            (b"content-security-policy", b"default-src 'self'; script-src 'self' 'unsafe-eval'; style-src 'self' "
                                         b"'unsafe-inline'; img-src 'self' data: blob:; connect-src 'self'; "
                                         b"frame-ancestors 'none'")]


class _Guard:
    """The ASGI layer before every route: the token, the Host, the method; then the security headers."""

    def __init__(self, app: Starlette, token: str, hosts: set[str]):
        self.app, self.token, self.hosts = app, token.encode(), hosts

    def _refusal(self, scope: dict) -> tuple[int, str] | None:
        request = Request(scope)
        given = request.query_params.get("token") or request.headers.get("x-exogym-token") or ""
        if not hmac.compare_digest(given.encode(), self.token):
            return 403, "403: this view needs the token printed by `exogym ui` (the address with ?token=...)"
        host = (request.headers.get("host") or "").rsplit(":", 1)[0].strip("[]").lower()
        if host not in self.hosts:
            return 403, f"403: host {host!r} is not the address this view serves"
        if request.method not in ("GET", "HEAD"):
            return 405, "405: the view only reads"
        return None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await PlainTextResponse(refusal[1], status_code=refusal[0])(scope, receive, send)
            return

        async def with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_HEADERS]}
            await send(message)

        await self.app(scope, receive, with_headers)
