"""A throwaway PostgreSQL server for the PostgreSQL stores' tests (src/agentkv/_postgres.py): made with ``initdb``
in a temporary folder, listening on a free loopback port (its unix socket in that folder), stopped and removed at
the end. PostgreSQL refuses to run as root: as root it runs as the ``postgres`` user (``runuser``).

Tests that use it skip, saying why, only where PostgreSQL's binaries (``/usr/lib/postgresql/*/bin``) are missing
(.ci/run installs them); psycopg comes with the dev extras.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from agentkv._engines._system import alive, free_port


def _bin() -> Path | None:
    """The newest installed PostgreSQL's binaries, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name))
    return Path(found[-1]).parent if found else None


class PostgresServer:
    """A server made in ``folder``, started and stopped at will (``start``, ``stop``); ``url`` reaches it."""

    def __init__(self, folder: Path, binaries: Path) -> None:
        self.folder, self.binaries = folder, binaries
        self.data = folder / "data"
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._as: list[str] = []
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("PostgreSQL refuses to run as root and this machine has no postgres user")
            os.chown(folder, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8")

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            [*self._as, str(self.binaries / tool), *args], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, f"{tool} failed: {done.stdout}{done.stderr}"

    def start(self) -> None:
        """Start it and wait until it takes connections."""
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -F -c shared_buffers=16MB"
        self._run(
            "pg_ctl", "start", "-w", "-t", "30", "-D", str(self.data), "-l", str(self.folder / "log"), "-o", options
        )

    def stop(self) -> None:
        """Stop it (``-m fast``: open connections are ended), wait until it has, and check that none of its
        processes is left."""
        postmaster = psutil.Process(int((self.data / "postmaster.pid").read_text().split()[0]))
        pids = {postmaster.pid, *(child.pid for child in postmaster.children(recursive=True))}
        self._run("pg_ctl", "stop", "-w", "-t", "30", "-m", "fast", "-D", str(self.data))
        assert alive(pids) == set(), f"PostgreSQL's processes {sorted(alive(pids))} outlived pg_ctl stop"

    @property
    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def reset(self) -> None:
        """Drop everything the tests made in its database."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as db:
            db.execute("DROP SCHEMA public CASCADE")
            db.execute("CREATE SCHEMA public")


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A running server, stopped (and its folder removed) at the end, whatever happened."""
    binaries = _bin()
    if binaries is None:
        pytest.skip(
            "PostgreSQL is not installed here (no /usr/lib/postgresql/*/bin/initdb): apt-get install postgresql"
        )
    folder = Path(tempfile.mkdtemp(prefix="agentkv-pg-"))  # not under pytest's 0700 folders: postgres reads it
    try:
        server = PostgresServer(folder, binaries)
        server.start()
        try:
            yield server
        finally:
            if server.running:
                server.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
