"""A throwaway PostgreSQL cluster for tests: ``initdb`` into a temporary folder, ``pg_ctl start`` on a
free loopback port, a superuser ``servegate`` with a random password, removed again by :meth:`stop`.

::

    cluster = running_cluster()          # LookupError (with the install command) without the binaries
    url = cluster.url(cluster.create_database("t_store"))
    ...
    cluster.stop()

The server is made cheap to start and to write to (no fsync: a test cluster is never kept). Its
password reaches ``initdb`` through a file (``--pwfile``) and ``pg_dump`` through a password file
(``PGPASSFILE``), never a command line. As root, the binaries run as ``postgres`` (else ``nobody``):
PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from servegate.proctree import terminate_tree

if TYPE_CHECKING:
    import psycopg

__all__ = ["PostgresCluster", "find_bin_dir", "running_cluster", "INSTALL_HINT"]

INSTALL_HINT = "apt-get install postgresql (or run `bash scripts/setup.sh --tests` as root)"
SUPERUSER = "servegate"
_BIN_DIRS = (Path("/usr/local/bin"), *sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True))
_TOOLS = ("initdb", "pg_ctl", "pg_dump")
_INITDB_TIMEOUT_S = 60.0
_START_WAIT_S = 30  # pg_ctl -t: how long pg_ctl waits for the server to accept connections
_STOP_WAIT_S = 15  # then SIGQUIT: nothing in a throwaway cluster needs a clean shutdown
_PORT_TRIES = 3  # a free port found by binding port 0 may be taken before the server binds it
_DB_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_SETTINGS = {
    # Throwaway: durability buys nothing and costs each test database and commit seconds.
    "fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
    "max_connections": "100", "shared_buffers": "32MB", "log_min_messages": "warning",
}


def find_bin_dir() -> Path:
    """The folder holding ``initdb``, ``pg_ctl`` and ``pg_dump`` (``/usr/local/bin`` or a Debian
    ``/usr/lib/postgresql/<version>/bin``); LookupError with the install command when none does."""
    for folder in _BIN_DIRS:
        if all(os.access(folder / tool, os.X_OK) for tool in _TOOLS):
            return folder
    searched = ", ".join(str(d) for d in _BIN_DIRS) or "/usr/local/bin, /usr/lib/postgresql/*/bin"
    raise LookupError(f"PostgreSQL server binaries ({', '.join(_TOOLS)}) not found in {searched}; install them: "
                      f"{INSTALL_HINT}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class _RunAs:
    """Who the server binaries run as: this process, or (as root) an unprivileged user."""

    uid: int | None
    gid: int | None

    @classmethod
    def unprivileged(cls) -> "_RunAs":
        if os.geteuid() != 0:
            return cls(None, None)
        for name in ("postgres", "nobody"):
            try:
                entry = pwd.getpwnam(name)
            except KeyError:
                continue
            return cls(entry.pw_uid, entry.pw_gid)
        raise LookupError("running as root and neither a 'postgres' nor a 'nobody' user exists to run PostgreSQL "
                          "as (it refuses root); create one (apt-get install postgresql does)")

    def own(self, path: Path) -> None:
        if self.uid is not None:
            os.chown(path, self.uid, self.gid)

    def run(self, args: list[str], timeout_s: float, cwd: Path) -> subprocess.CompletedProcess:
        """Run a server binary (argument list, timeout) as this user; output captured."""
        kwargs = {} if self.uid is None else {"user": self.uid, "group": self.gid, "extra_groups": []}
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, cwd=cwd, check=False,
                              **kwargs)


class PostgresCluster:
    """One PostgreSQL cluster in a temporary folder (``/tmp/servegate-pg-XXXX``); start it with
    :meth:`start` (or :func:`running_cluster`), end it with :meth:`stop`."""

    def __init__(self, bin_dir: Path | None = None) -> None:
        self.bin_dir = bin_dir or find_bin_dir()
        self._run_as = _RunAs.unprivileged()
        self.folder = Path(tempfile.mkdtemp(prefix="servegate-pg-"))
        self._run_as.own(self.folder)
        self.data_dir = self.folder / "data"
        self.log_file = self.folder / "server.log"
        self._password = secrets.token_urlsafe(24)
        self._passfile = self.folder / "pgpass"
        self.port: int | None = None
        self.start_s: float | None = None  # seconds from initdb to accepting connections
        self._started = False

    # ---- life cycle ---------------------------------------------------------------------------
    def start(self) -> "PostgresCluster":
        """initdb, then pg_ctl start on a free loopback port (another port when one was taken meanwhile)."""
        t0 = time.perf_counter()
        try:
            self._initdb()
            for attempt in range(1, _PORT_TRIES + 1):
                self.port = _free_port()
                self._write_settings()
                result = self._tool("pg_ctl", "start", "-D", str(self.data_dir), "-l", str(self.log_file), "-w",
                                    "-t", str(_START_WAIT_S), timeout_s=_START_WAIT_S + 15)
                if result.returncode == 0:
                    self._started = True
                    break
                if attempt == _PORT_TRIES or "could not bind" not in self._log_tail():
                    raise RuntimeError(f"pg_ctl start failed (exit {result.returncode}): {result.stderr.strip()}; "
                                       f"server log {self.log_file}:\n{self._log_tail()}")
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0
        return self

    def _initdb(self) -> None:
        pwfile = self.folder / "initdb-password"
        pwfile.touch(mode=0o600)
        pwfile.write_text(self._password + "\n")
        self._run_as.own(pwfile)
        try:
            result = self._tool("initdb", "-D", str(self.data_dir), "-U", SUPERUSER, f"--pwfile={pwfile}",
                                "--auth=scram-sha-256", "--encoding=UTF8", "--locale=C", "--no-sync",
                                "--no-instructions", timeout_s=_INITDB_TIMEOUT_S)
        finally:
            pwfile.unlink(missing_ok=True)
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed (exit {result.returncode}): {result.stderr.strip()}")
        self._passfile.touch(mode=0o600)
        self._passfile.write_text(f"127.0.0.1:*:*:{SUPERUSER}:{self._password}\n")

    def _write_settings(self) -> None:
        # postgresql.auto.conf is read after postgresql.conf; settings here, not on pg_ctl's -o (a shell string).
        settings = {**_SETTINGS, "port": str(self.port), "listen_addresses": "'127.0.0.1'",
                    "unix_socket_directories": f"'{self.folder}'"}
        conf = self.data_dir / "postgresql.auto.conf"
        conf.write_text("# written by tests/pgcluster.py\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
        self._run_as.own(conf)

    def stop(self) -> None:
        """``pg_ctl stop -m fast`` (the server's processes ended for sure if that fails), then remove the folder."""
        try:
            if self._started or (self.data_dir / "postmaster.pid").exists():
                try:
                    result = self._tool("pg_ctl", "stop", "-D", str(self.data_dir), "-m", "fast", "-w",
                                        "-t", str(_STOP_WAIT_S), timeout_s=_STOP_WAIT_S + 15)
                    failure = None if result.returncode == 0 else f"exit {result.returncode}: {result.stderr.strip()}"
                except subprocess.TimeoutExpired:
                    failure = "pg_ctl itself did not return"
                if failure:
                    warnings.warn(f"pg_ctl stop -m fast did not stop the test cluster in {_STOP_WAIT_S} s ({failure}); "
                                  f"ending it with SIGQUIT. Server log:\n{self._log_tail()}", stacklevel=2)
                    self._kill_postmaster()
                self._started = False
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _kill_postmaster(self) -> None:
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return
        try:
            os.kill(pid, signal.SIGQUIT)  # immediate shutdown of the postmaster and its backends
        except ProcessLookupError:
            return
        terminate_tree(pid, timeout_s=10.0)

    def __enter__(self) -> "PostgresCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- use ----------------------------------------------------------------------------------
    def url(self, db: str = "postgres", driver: str = "psycopg") -> str:
        """The SQLAlchemy URL of database ``db`` as the superuser (password included: a secret)."""
        if self.port is None:
            raise RuntimeError("the cluster is not started; call start() first")
        return f"postgresql+{driver}://{SUPERUSER}:{self._password}@127.0.0.1:{self.port}/{db}"

    @property
    def password(self) -> str:
        """The superuser's password (for tests that look for it where it must not be)."""
        return self._password

    def create_database(self, name: str) -> str:
        """Create an empty database ``name`` (lower-case letters, digits, ``_``; unique per test); returns it."""
        from psycopg import sql

        if not _DB_NAME_RE.match(name):
            raise ValueError(f"database name {name!r} must be 1-63 lower-case letters, digits or _, not starting "
                             f"with a digit")
        with self._admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return name

    def drop_database(self, name: str) -> None:
        """Drop database ``name``, ending any connection still open to it (a test's database, once it is done)."""
        from psycopg import sql

        with self._admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def dump(self, db: str) -> str:
        """``pg_dump`` of database ``db`` as SQL text (schema and data)."""
        env = {**os.environ, "PGPASSFILE": str(self._passfile)}
        env.pop("PGPASSWORD", None)
        # Runs as this process (it reads the password file, owned by this process's user).
        result = subprocess.run([str(self.bin_dir / "pg_dump"), "-h", "127.0.0.1", "-p", str(self.port), "-U",
                                 SUPERUSER, "--no-password", "-d", db], capture_output=True, text=True, timeout=60,
                                env=env, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"pg_dump {db} failed (exit {result.returncode}): {result.stderr.strip()}")
        return result.stdout

    # ---- helpers ------------------------------------------------------------------------------
    def _admin(self) -> "psycopg.Connection":
        """A connection to the ``postgres`` database for CREATE/DROP DATABASE (outside a transaction)."""
        import psycopg  # on use: a missing driver fails the PostgreSQL tests, not every test's collection

        return psycopg.connect(host="127.0.0.1", port=self.port, user=SUPERUSER, password=self._password,
                               dbname="postgres", autocommit=True, connect_timeout=10)

    def _tool(self, name: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
        return self._run_as.run([str(self.bin_dir / name), *args], timeout_s, cwd=self.folder)

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"


def running_cluster() -> PostgresCluster:
    """A started cluster; LookupError with the install command when the PostgreSQL binaries are absent."""
    return PostgresCluster(find_bin_dir()).start()
