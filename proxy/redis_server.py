"""Launch a private Redis-compatible server as a child process.

Used by ``serve`` when no ``redis.url`` is configured (the embedded default) and by the tests
for their throwaway servers. It runs the real ``redis-server`` (or ``valkey-server``) binary:
there is no in-process substitute for the store.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

from proxy.errors import ConfigError

log = logging.getLogger("proxy.redis_server")
BINARIES = ("redis-server", "valkey-server")
INSTALL_HINT = (
    "no redis-server or valkey-server binary found on PATH; install one "
    "(Debian/Ubuntu: apt-get install redis-server), or give a Redis URL: --redis-url, or redis.url "
    "in the config"
)


class StartCancelled(Exception):
    """A start given up because its caller was asked to stop (``serve`` got SIGTERM or SIGINT
    while the server loaded its AOF); a server it had spawned is stopped already."""


def find_server_binary() -> str:
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    raise ConfigError(INSTALL_HINT)


# A unix socket's path must fit sun_path: 108 bytes on Linux, 104 on macOS.
SOCKET_PATH_MAX_BYTES = 103


def socket_path_for(data_dir: Path) -> Path:
    """Where the server for ``data_dir`` listens: inside it when the path fits, else at a
    short path derived from it, so that a second proxy on the same data directory still
    finds the running server (a checkout deep in a home directory is common)."""
    inside = data_dir / "redis.sock"
    if len(os.fsencode(inside)) <= SOCKET_PATH_MAX_BYTES:
        return inside
    digest = hashlib.sha256(os.fsencode(data_dir)).hexdigest()[:16]
    for base in (tempfile.gettempdir(), "/tmp"):
        short = Path(base) / f"llm-billing-proxy-{os.getuid()}" / f"redis-{digest}.sock"
        if len(os.fsencode(short)) <= SOCKET_PATH_MAX_BYTES:
            return short
    raise ConfigError(f"no unix socket path short enough for {data_dir}; set redis.url (or --redis-url)")


def _private_dir(path: Path) -> None:
    """Create ``path`` for our socket, refusing one another user made or can enter: the
    socket is the store's only access control."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigError(
            f"{path} is not a private directory of this user; remove it or set redis.url (or --redis-url)"
        )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServerProcess:
    """One redis-server child: on a unix socket by default, or a loopback TCP port."""

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        appendonly: bool = True,
        extra_args: tuple[str, ...] = (),
        binary: str | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.socket_path = socket_path_for(data_dir) if port is None else data_dir / "redis.sock"
        self.port = port
        self.appendonly = appendonly
        self.extra_args = extra_args
        self.binary = binary or find_server_binary()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is not None:
            return f"redis://127.0.0.1:{self.port}/0"
        # Quoted: both clients (redis-py, ``resp``) decode a path's escapes, and a '?' or '#' in
        # it would end the path.
        return f"unix://{quote(str(self.socket_path))}?db=0"

    def _args(self) -> list[str]:
        args = [
            self.binary,
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            # Full, it refuses writes (calls get 503) rather than drop a budget's counter or a lease.
            "--maxmemory-policy",
            "noeviction",
            "--logfile",
            str(self.data_dir / "redis.log"),
            "--daemonize",
            "no",
        ]
        if self.port is not None:
            args += ["--port", str(self.port), "--bind", "127.0.0.1"]
        else:
            args += ["--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        return args + list(self.extra_args)

    def start(
        self,
        timeout_s: float = 10.0,
        *,
        keep_fds: tuple[int, ...] = (),
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        """Start and wait for its PONG; ``keep_fds`` are handed to the server (a lock it holds
        for as long as it lives). Once ``cancelled()`` says so, the server is stopped and
        ``StartCancelled`` raised: the wait may be a large AOF's load."""
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"redis.data_dir {self.data_dir}: {err.strerror or err}") from None
        if self.port is None and self.socket_path.parent != self.data_dir:
            _private_dir(self.socket_path.parent)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        log = self.data_dir / "redis.log"
        # The log holds earlier runs too: only what this start adds tells why it failed.
        logged_bytes = log.stat().st_size if log.exists() else 0
        # What it says before its log is open (a bad option, a log it cannot write) goes here.
        with open(self.data_dir / "redis.stderr", "wb") as stderr:
            self.process = subprocess.Popen(
                self._args(),
                pass_fds=keep_fds,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                detail = _tail(self.data_dir / "redis.stderr", 0) + _tail(log, logged_bytes)
                raise ConfigError(
                    f"redis-server exited at start (code {self.process.returncode}): "
                    f"{detail.strip()[-500:] or 'it said nothing'}"
                )
            # Ours, not another server that answers on the port (it was free when picked): that
            # one is found out when ours exits, unable to listen.
            if self.answers_ping() and self.server_pid() == self.process.pid:
                return
            if cancelled is not None and cancelled():
                self.stop()
                raise StartCancelled("asked to stop while redis-server started")
            time.sleep(0.02)
        self.stop()
        raise ConfigError(f"redis-server did not answer within {timeout_s}s")

    def holds_data(self) -> bool:
        """Whether a server ran here with its AOF on: Redis 7 writes a directory, older ones a file."""
        return any((self.data_dir / name).exists() for name in ("appendonlydir", "appendonly.aof"))

    def answers_ping(self) -> bool:
        try:
            if self.port is not None:
                conn = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
            else:
                if not self.socket_path.exists():
                    return False
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.settimeout(0.5)
                conn.connect(str(self.socket_path))
            with conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def server_pid(self) -> int | None:
        """The pid of the server answering here (``INFO server``'s ``process_id``), or None."""
        try:
            if self.port is not None:
                conn = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
            else:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.settimeout(0.5)
                conn.connect(str(self.socket_path))
            with conn:
                conn.sendall(b"INFO server\r\n")
                reply = b""
                while b"process_id:" not in reply or not reply.split(b"process_id:", 1)[1].count(b"\r\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    reply += chunk
        except OSError:
            return None
        for line in reply.split(b"\r\n"):
            if line.startswith(b"process_id:") and line[11:].isdigit():
                return int(line[11:])
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop gracefully (SIGTERM makes redis flush its AOF)."""
        self._signal(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """Kill -9, as a crash would."""
        self._signal(signal.SIGKILL, 5.0)

    def _signal(self, sig: signal.Signals, timeout_s: float) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, sig)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class EmbeddedKeeper:
    """Keeps the embedded server of a data directory running for a serving proxy.

    The server holds a lock in the data directory for its life: two proxies starting at once on
    one directory share one server (two on one AOF would corrupt it). A server that dies (killed,
    out of memory) or that another proxy stopped on its way out is started again within
    ``interval_s``, from its AOF: a proxy never serves 503s for ever while ``/healthz`` says
    alive. On exit, the server this proxy started is stopped (another proxy still using it
    starts it again)."""

    def __init__(
        self,
        server: RedisServerProcess,
        *,
        interval_s: float = 1.0,
        start_timeout_s: float = 60.0,
        take_over: bool = True,
    ) -> None:
        self.server = server
        # False for a command that only reads the store (ledger, report): a server it finds
        # running may serve a live proxy the owner file does not name; it is not its to stop.
        self.take_over = take_over
        self.interval_s = interval_s
        self.start_timeout_s = start_timeout_s  # loading a large AOF takes a while
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # A server whose proxy died (kill -9) and that this process took over: stopped on exit.
        self._adopted: int | None = None

    @property
    def _owner_path(self) -> Path:
        return self.server.data_dir / "server.owner"

    def _write_owner(self) -> None:
        with contextlib.suppress(OSError):
            self._owner_path.write_text(str(os.getpid()))

    def _adopt_if_orphaned(self) -> None:
        """A server that holds the directory's lock was started by a proxy; if that proxy is
        gone (killed -9: the server, in a session of its own, lives on), this one takes it over
        and stops it on exit, as its own. Not a server started by hand (it holds no lock)."""
        if not self.take_over:
            return
        try:
            owner = int(self._owner_path.read_text().strip())
        except (OSError, ValueError):
            return
        if owner == os.getpid():
            return
        try:
            os.kill(owner, 0)
            return  # its proxy lives
        except ProcessLookupError:
            pass
        except PermissionError:
            return
        pid = self.server.server_pid()
        if pid is None:
            return
        with contextlib.suppress(OSError, ValueError):
            # A proxy records itself before its server answers: one whose owner changed since
            # it was read is another proxy's new server, not the dead one's.
            if int(self._owner_path.read_text().strip()) != owner:
                return
        self._adopted = pid
        self._write_owner()
        log.warning("took over an embedded redis-server its proxy left running", extra={"pid": pid})

    def ensure(self, cancelled: Callable[[], bool] | None = None) -> bool:
        """A server answers on the socket once this returns (or ``start_timeout_s`` passed);
        True when this call started it. ``StartCancelled`` once ``cancelled()`` says so, the
        server this call started stopped.

        Whether a server of this directory lives is told by a lock the server itself holds for
        its whole life (its copy of the locked file), not by a PING: a server that is slow to
        answer (an AOF rewrite's fork, a long script, loading) is alive, and a second one on
        its AOF would corrupt it."""
        try:
            self.server.data_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.server.data_dir / "server.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            raise ConfigError(f"redis.data_dir {self.server.data_dir}: {err.strerror or err}") from None
        try:
            deadline = time.monotonic() + self.start_timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    pass
                # A server lives, another proxy is starting one, or one is on its way out: the
                # lock is tried again meanwhile, since a server that exits leaves nobody to
                # start the next one but the proxies waiting here.
                if self.server.answers_ping():
                    self._adopt_if_orphaned()
                    return False
                if time.monotonic() >= deadline:
                    return False
                if cancelled is not None and cancelled():
                    raise StartCancelled("asked to stop while waiting for redis-server")
                time.sleep(0.05)
            if self.server.answers_ping():
                return False  # one that holds no lock (started by hand, or by an older version)
            if cancelled is not None and cancelled():
                raise StartCancelled("asked to stop before redis-server started")
            # Recorded before the server answers: a proxy waiting on the lock takes the first
            # PONG as its cue to read the owner, and an older owner (dead) would hand it this
            # live proxy's server to stop.
            self._write_owner()
            self.server.start(self.start_timeout_s, keep_fds=(fd,), cancelled=cancelled)
            self._adopted = None
            return True
        finally:
            os.close(fd)  # the server keeps its copy, and with it the lock

    def watch(self) -> None:
        self._thread = threading.Thread(target=self._run, name="embedded-redis", daemon=True)
        self._thread.start()

    def _held_by_a_server(self) -> bool:
        """Whether the directory's lock is held: by a server (for its life) or a proxy starting
        one, never by a server started by hand."""
        try:
            fd = os.open(self.server.data_dir / "server.lock", os.O_RDWR)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # and with it a lock it took
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.server.answers_ping():
                # The proxy that started it killed -9 while this one serves on it: taken over
                # here, or the last proxy of the directory would leave it running on exit.
                if self.server.process is None and self._adopted is None and self._held_by_a_server():
                    self._adopt_if_orphaned()
                continue
            try:
                if self.ensure():
                    log.warning(
                        "embedded redis-server was down: started again",
                        extra={"socket": str(self.server.socket_path)},
                    )
            except Exception as err:  # out of memory, a start that failed: tried again next round
                log.error(
                    "embedded redis-server could not be started again", extra={"error": repr(err)[:300]}
                )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.server.stop()  # only a server this process started (or took over)
        adopted = self._adopted
        if adopted is not None and self.server.process is None and self.server.server_pid() == adopted:
            with contextlib.suppress(ProcessLookupError):
                os.kill(adopted, signal.SIGTERM)
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                try:
                    os.kill(adopted, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.02)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(adopted, signal.SIGKILL)


def _tail(path: Path, offset_bytes: int) -> str:
    """What ``path`` holds past ``offset_bytes`` (nothing when it is gone)."""
    try:
        with open(path, "rb") as file:
            if os.fstat(file.fileno()).st_size >= offset_bytes:  # else rotated: all of it is new
                file.seek(offset_bytes)
            return file.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
