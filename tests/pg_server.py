"""A throwaway PostgreSQL 15 server for the sweep tests: initdb in a temporary folder, pg_ctl on a free loopback
port. PostgreSQL refuses to run as root, so under root it runs as the user `nobody` (runuser)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

BIN = Path("/usr/lib/postgresql/15/bin")


def missing() -> str | None:
    """Why no server can be started here (None: it can)."""
    if not (BIN / "initdb").exists() or not (BIN / "pg_ctl").exists():
        return f"PostgreSQL 15 is not installed ({BIN}/initdb, pg_ctl): apt-get install postgresql-15"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg 3 is not installed: pip install 'exogym[postgres]'"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser: PostgreSQL refuses to run as root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    """start(), stop() (fast shutdown: every connection drops), url."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.data, self.log = folder / "data", folder / "server.log"
        self.port = _free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        if os.geteuid() == 0:  # the server's folder belongs to the user it runs as
            os.chmod(folder, 0o777)
        self._run(str(BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--no-sync")

    def _run(self, *cmd: str) -> None:
        prefix = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
        subprocess.run(prefix + list(cmd), check=True, capture_output=True, cwd="/", timeout=120)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(str(BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def stop(self) -> None:
        self._run(str(BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
