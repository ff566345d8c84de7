"""A rollout server process megappo starts and reaps (standard library only): `ManagedServer`, whose engine's parts
(launch command, environment, API key delivery, the identity check's keyed path, the bind-failure log line) are
hooks of its subclasses, `SGLangServer` (sglang/server.py) and `VLLMServer` (vllm/server.py).

The engine lives in its own environment (it pins its own torch and transformers), so the server is started with
that environment's python (`python=`), and megappo only speaks HTTP to it.

Lifecycle: a started server never outlives this process. It runs under a watchdog (`platform/reaper.py`) that kills
the server's whole process group when this process dies in any way (SIGKILL included) or asks it to (`stop()`, also
called by `with`, an atexit hook, and a failed or interrupted `start()`, Ctrl-C included). The server's log is a
temporary file kept only when something failed, or, once `keep_log_in(DIR)` was called (a run's servers: its
`servers/` folder), `DIR/<engine>_server_<host>_<port>.log` (`server_log_path`), kept; a failed start's error ends
with its last lines. The server's temporary folder (TMPDIR) is a private one that the watchdog removes when the
server is gone: vLLM leaves a `vllm_dist_<uuid>` rendezvous file there per server, which a killed server never
removes.

Job-wide signals: the server is its parent's helper, and only its parent stops it. Slurm signals every process of a
job step (preemption's SIGTERM, `--signal`, `scancel --signal [--full]`, srun's SIGINT), which would kill the server
before the trainer finishes the step it is in and saves; so the watchdog and the server (its scheduler and
detokenizer too) ignore SIGTERM, SIGINT and SIGUSR1, blocked from the fork on (`job_signals_blocked`), the engine's
own handlers notwithstanding (`ignore_job_signals.py` runs its launcher). `stop()` asks the watchdog through a pipe,
and the watchdog stops the server with SIGKILL; a terminal's Ctrl-C never reached the server (its own session) and
still interrupts the caller, whose `stop()` or death then ends it.

Identity: `/health` may answer without a key and whoever holds the port answers it, so a server counts as started
only when this process's watchdog is alive, its log shows no failed bind, and the server takes its API key and
refuses another (`KEYED_PATH`). Each server gets a random API key unless one is given; it reaches the server off the
command line (which every local user can read: `key_delivery`), and `http_client.http_json` sends it to that
server's URL on every request.
"""
from __future__ import annotations

import atexit
import errno
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

from megappo.platform import reaper
from megappo.platform.job_signals import job_signals_blocked
from megappo.rollout.serving.http_client import http_status, register_api_key

REAPER = reaper.__file__  # run by path with `python -I`: the server's python need not see megappo
# runs a server's `python -m X ...`, `-c` or `FILE.py` launcher with the job-wide signals ignored for good
SHELTER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ignore_job_signals.py")
_LIVE: dict[int, "ManagedServer"] = {}  # started, not yet stopped: the atexit hook stops them


class PortTakenError(RuntimeError):
    pass


_TORCHRUN_ENV = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK"}


def server_log_path(log_dir: str, engine: str, url: str) -> str:
    """Where the server of `engine` at `url` keeps its log in `log_dir` (a run's `servers/` folder): a name any rank
    (and a `megappo rollout-server --log-dir` elsewhere) derives from the URL alone, so an error can quote it."""
    host_port = url.split("://", 1)[-1].rstrip("/")
    name = "".join(c if c.isalnum() or c in ".-" else "_" for c in host_port)
    return os.path.join(log_dir, f"{engine.lower()}_server_{name}.log")


# a unix socket's path has at most 107 bytes (sun_path), and vLLM puts its engine's IPC sockets in TMPDIR under
# 36-character names (measured: "ipc path ... is longer than 107 characters" under a pytest tmp_path)
_SOCKET_PATH_MAX, _SOCKET_NAME = 107, 37


def _scratch_dir() -> str:
    """A private TMPDIR for one server: in the temporary folder, or /tmp when that one's path is too long for the
    engine's sockets."""
    base = tempfile.gettempdir()
    if len(base) + len("/megappo-12345678") + _SOCKET_NAME > _SOCKET_PATH_MAX and os.path.isdir("/tmp"):
        base = "/tmp"
    return tempfile.mkdtemp(prefix="megappo-", dir=base)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _port_is_free(host: str, port: int) -> bool:
    # SO_REUSEADDR as uvicorn binds: a port whose old connections linger in TIME_WAIT is free for it too
    with socket.socket(_family(host)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise
    return True


class ManagedServer:
    """One server process under a watchdog; a context manager that stops it. The engine's parts are the hooks a
    subclass overrides: `command` (the launch command), the environment (`self.env`, set up in its constructor),
    `key_delivery` (how the API key reaches the server), `KEYED_PATH` (the identity check's keyed request) and
    `bind_failed` (the log line of a port someone else holds). `ENGINE` names the engine in every message.

    `port=None` picks a free port (and another one if it turns out to be taken); a given port that is taken is an
    error naming it. `host` is the address the server binds (loopback unless set: other nodes need the cluster
    address, or 0.0.0.0). `api_key=None` makes a random one (`self.api_key`)."""

    ENGINE = "managed"  # "SGLang server ...", "vLLM server ..."
    KEYED_PATH = "/model_info"  # answers 200 with the server's key and 401 with another

    def __init__(self, *, python: str = "python", port: Optional[int] = None, host: str = "127.0.0.1",
                 api_key: Optional[str] = None, port_attempts: int = 5, stop_grace_s: float = 15.0):
        self.python, self.host, self.port_auto = python, host, port is None
        # hex: a random key starting with "-" would read as a flag to an argument parser (seen with SGLang: exit 2)
        self.api_key = api_key or secrets.token_hex(24)
        self.port_attempts, self.stop_grace_s = port_attempts, stop_grace_s
        # not the launcher's rendezvous: under torchrun the server would otherwise read RANK/WORLD_SIZE/MASTER_* and
        # wait in its own torch.distributed init for ranks that never come (measured: a hang at "Init parallel")
        self.env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
        self.env["PYTHONPATH"] = ""  # the server's own environment, not the caller's
        self.proc: Optional[subprocess.Popen] = None  # the watchdog
        self.failed = False  # something went wrong: the log is kept
        self.log_dir: Optional[str] = None  # keep_log_in: the log's folder (kept there), else a temporary file
        self.scratch: Optional[str] = None  # the server's TMPDIR while it runs
        self._key_file: Optional[str] = None
        self._ready = False  # started and answering as ours
        self._set_port(port or free_port(host))
        self.log = self._new_log()

    # -- the engine's hooks ----------------------------------------------------------------------------------------
    def command(self, port: int) -> list[str]:
        """The server's launch command on `port` (`python -m X ...`, `python -c CODE ...` or `python FILE.py ...`),
        without the API key."""
        raise NotImplementedError

    def key_delivery(self) -> tuple[list[str], dict[str, str]]:
        """The arguments appended to `command` and the environment added for one start that hand the server its
        API key, never the key itself on the command line (which every local user can read). A file written here is
        `self._key_file` (removed once the server is up, or stopped)."""
        raise NotImplementedError

    def bind_failed(self, log_tail: str) -> bool:
        """Whether the log says our port was taken. uvicorn logs "[Errno 98] error while attempting to bind on
        address ('127.0.0.1', PORT): address already in use", and SGLang 0.5.23 then hangs instead of exiting
        (measured) while the port's owner answers /health."""
        return any("error while attempting to bind" in line and f", {self.port})" in line
                   for line in log_tail.splitlines())

    # -- lifecycle -------------------------------------------------------------------------------------------------
    @property
    def cmd(self) -> list[str]:
        return self.command(self.port)

    def _new_log(self):
        if self.log_dir is None:
            return tempfile.NamedTemporaryFile("w+", prefix=f"{self.ENGINE.lower()}_server_", suffix=".log",
                                               delete=False)
        os.makedirs(self.log_dir, exist_ok=True)
        # appended: a server restarted on its port keeps the dead one's lines above its own
        log = open(server_log_path(self.log_dir, self.ENGINE, self.url), "a+")
        log.write(f"megappo: {self.ENGINE} server {self.url} starting at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        log.flush()
        return log

    def keep_log_in(self, log_dir: str) -> None:
        """Log to `log_dir` (`server_log_path`) and keep the log there, instead of a temporary file; before
        `start`."""
        if self.proc is not None:
            raise RuntimeError(f"{self.ENGINE} server {self.url}: keep_log_in comes before start")
        self.log.close()
        if self.log_dir is None:
            os.unlink(self.log.name)
        self.log_dir = os.path.abspath(os.path.expanduser(log_dir))
        self.log = self._new_log()

    def _set_port(self, port: int) -> None:
        self.port = port
        url_host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        self.url = f"http://{f'[{url_host}]' if ':' in url_host else url_host}:{port}"

    def start(self, timeout: float = 600) -> float:
        """Launch and wait until the server is up and ours; return the seconds it took. Raises RuntimeError with
        the log's tail (and stops what it started) on failure, timeout or interruption."""
        if self.proc is not None:
            raise RuntimeError(f"{self.ENGINE} server {self.url} is already started")
        t0 = time.time()
        for attempt in range(self.port_attempts):
            try:
                self._start_once(t0, t0 + timeout)
                return time.time() - t0
            except PortTakenError:
                if not self.port_auto:
                    self.failed = True
                    self.stop()
                    raise RuntimeError(
                        f"{self.ENGINE} server port {self.port} on {self.host} is taken by another process (it was set "
                        f"by the caller, so no other port is tried; log {self.log.name}):\n{self.log_tail()}"
                    ) from None
                if attempt + 1 < self.port_attempts:
                    self._discard(free_port(self.host))
            except BaseException:  # Ctrl-C included: never leave a half-started server behind
                self.failed = True
                self.stop()
                raise
        self.failed = True
        self.stop()
        raise RuntimeError(f"{self.ENGINE} server: {self.port_attempts} automatically chosen ports were all taken "
                           f"(last {self.port}; log {self.log.name}):\n{self.log_tail()}")

    def _start_once(self, t0: float, deadline: float) -> None:
        if not _port_is_free(self.host, self.port):
            raise PortTakenError(self.port)
        key_args, key_env = self.key_delivery()
        self.scratch = _scratch_dir()
        with job_signals_blocked():
            self.proc = subprocess.Popen(
                [self.python, "-I", REAPER, str(os.getpid()), "--grace", str(self.stop_grace_s),
                 "--ignore-job-signals", "--remove", self.scratch, "--", *self._sheltered(self.cmd), *key_args],
                stdout=self.log, stderr=subprocess.STDOUT, env={**self.env, **key_env, "TMPDIR": self.scratch},
                stdin=subprocess.PIPE,  # stop(): a line on it; a job-wide signal cannot stop the server
                # its own session: Ctrl-C at the terminal and signals to the caller's process group are the
                # caller's to handle (a trainer finishing its step needs its server); the watchdog follows the
                # caller's death
                start_new_session=True)
        _LIVE[id(self)] = self
        _register_atexit()
        register_api_key(self.url, self.api_key)
        while time.time() < deadline:
            if self.bind_failed(self.log_tail(200)):
                raise PortTakenError(self.port)
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.ENGINE} server exited with code {self.proc.returncode} while starting "
                                   f"(log {self.log.name}):\n{self.log_tail()}")
            if self._answers_as_ours():
                self._remove_key_file()
                self._ready = True
                return
            time.sleep(1)
        raise RuntimeError(f"{self.ENGINE} server did not become healthy in {time.time() - t0:.0f} s "
                           f"(log {self.log.name}):\n{self.log_tail()}")

    @staticmethod
    def _sheltered(cmd: Sequence[str]) -> list[str]:
        """`python -m X ...` / `python -c CODE ...` / `python FILE.py ...` run through ignore_job_signals.py."""
        cmd = list(cmd)
        sheltered = len(cmd) > 2 and cmd[1] in ("-m", "-c") or len(cmd) > 1 and cmd[1].endswith(".py")
        return [cmd[0], SHELTER, *cmd[1:]] if sheltered else cmd

    def _answers_as_ours(self) -> bool:
        if http_status(self.url + "/health", self.api_key) != 200:
            return False
        # /health may need no key; whoever takes ours and refuses another holds our random key: it is our server
        return (http_status(self.url + self.KEYED_PATH, self.api_key) == 200
                and http_status(self.url + self.KEYED_PATH, "not-" + self.api_key) == 401
                and self.proc is not None and self.proc.poll() is None)

    def _remove_key_file(self) -> None:
        if self._key_file:
            try:
                os.unlink(self._key_file)
            except FileNotFoundError:
                pass
            self._key_file = None

    def log_tail(self, lines: int = 40) -> str:
        if not self.log.closed:
            self.log.flush()
        try:
            with open(self.log.name, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except FileNotFoundError:
            return ""

    def _discard(self, port: int) -> None:
        """Stop this attempt's process; the next one runs on `port`, with a fresh log."""
        self.stop(keep_log=self.log_dir is not None)
        self.failed = False
        self._set_port(port)
        self.log = self._new_log()

    def stop(self, keep_log: Optional[bool] = None) -> None:
        """Stop the server and its children (through the watchdog). A temporary log is deleted unless something
        failed (a failed start, a server that had exited by itself) or `keep_log`; one in `log_dir` is kept."""
        proc, ready, self.proc, self._ready = self.proc, self._ready, None, False
        _LIVE.pop(id(self), None)
        self._remove_key_file()
        if proc is not None:
            register_api_key(self.url, None)
            if proc.poll() is not None:  # gone before we asked: a crash, whose log tells why
                self.failed = True
                if ready:  # (a failed start says so in its error)
                    print(f"{self.ENGINE} server {self.url} had exited with code {proc.returncode}; "
                          f"log {self.log.name}", file=sys.stderr)
            else:
                try:  # the watchdog's stop request (it ignores SIGTERM)
                    proc.stdin.write(b"stop\n")
                    proc.stdin.close()
                except OSError:  # it died meanwhile: waited for below
                    pass
                try:
                    proc.wait(timeout=self.stop_grace_s + 15)
                except subprocess.TimeoutExpired:
                    self.failed = True
                    proc.kill()  # the server dies with it (its parent-death signal); its children follow
                    proc.wait()
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        if self.scratch is not None:  # the watchdog removed it, unless it was killed itself
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
        if not self.log.closed:
            self.log.close()
        if self.log_dir is None and not (self.failed if keep_log is None else keep_log):
            try:
                os.unlink(self.log.name)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "ManagedServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


_atexit_registered = False


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(lambda: [s.stop() for s in list(_LIVE.values())])
        _atexit_registered = True
