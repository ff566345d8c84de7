"""Start, probe and stop an SGLang server process, and talk JSON to it (standard library only).

SGLang lives in its own environment (it pins its own torch and transformers), so the server is started with that
environment's python (`python=`), and megappo only speaks HTTP to it. On a machine without CUDA the CPU flags are
added (`SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend torch_native`); tools/sglang/install_cpu.sh
builds an environment in which that runs.

Lifecycle: a started server never outlives this process. It runs under a watchdog (`reaper.py`) that kills the
server's whole process group when this process dies in any way (SIGKILL included) or asks it to (`stop()`, also
called by `with`, an atexit hook, and a failed or interrupted `start()`, Ctrl-C included). The server's log is a
temporary file kept only when something failed; a failed start's error ends with its last lines.

Job-wide signals: the server is its parent's helper, and only its parent stops it. Slurm signals every process of a
job step (preemption's SIGTERM, `--signal`, `scancel --signal [--full]`, srun's SIGINT), which would kill the server
before the trainer finishes the step it is in and saves; so the watchdog and the server (its scheduler and
detokenizer too) ignore SIGTERM, SIGINT and SIGUSR1, blocked from the fork on (`job_signals_blocked`), SGLang's own
handlers notwithstanding (`ignore_job_signals.py` runs its launcher). `stop()` asks the watchdog through a pipe, and
the watchdog stops the server with SIGKILL; a terminal's Ctrl-C never reached the server (its own session) and
still interrupts the caller, whose `stop()` or death then ends it.

Identity: `/health` answers without a key and whoever holds the port answers it, so a server counts as started only
when this process's watchdog is alive, its log shows no failed bind, and the server takes its API key and refuses
another. Each server gets a random API key unless one is given; it reaches SGLang in a 0600 config file, not on the
command line (which every local user can read), and `http_client.http_json` sends it to that server's URL on every
request.
"""
from __future__ import annotations

import atexit
import errno
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

from megappo.platform.job_signals import job_signals_blocked
from megappo.rollout.sglang.http_client import http_status, register_api_key
from megappo.rollout.sglang.vlm import server_options

REAPER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reaper.py")
# runs `python -m sglang.launch_server ...` (or a router's `-c` launcher) with the job-wide signals ignored for good
SHELTER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ignore_job_signals.py")
_LIVE: dict[int, "SGLangServer"] = {}  # started, not yet stopped: the atexit hook stops them


class PortTakenError(RuntimeError):
    pass


_TORCHRUN_ENV = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK"}


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


class SGLangServer:
    """One `python -m sglang.launch_server` process under a watchdog; a context manager that stops it.

    `port=None` picks a free port (and another one if it turns out to be taken); a given port that is taken is an
    error naming it. `host` is the address the server binds (loopback unless set: other nodes need the cluster
    address, or 0.0.0.0). `api_key=None` makes a random one (`self.api_key`)."""

    def __init__(self, model_path: str, *, python: str = "python", port: Optional[int] = None, cuda: bool = False,
                 dtype: str = "float32", max_total_tokens: int = 4096, extra_args: Sequence[str] = (),
                 trust_remote_code: bool = False, host: str = "127.0.0.1", api_key: Optional[str] = None,
                 port_attempts: int = 5, stop_grace_s: float = 15.0):
        self.python, self.host, self.port_auto = python, host, port is None
        self._launcher = ["-m", "sglang.launch_server"]
        # hex: a random key starting with "-" would read as a flag to SGLang's argument parser (seen: exit 2)
        self.api_key = api_key or secrets.token_hex(24)
        if self.api_key.startswith("-"):
            raise ValueError("an SGLang API key must not start with '-' (SGLang's argument parser takes it for a flag)")
        self.port_attempts, self.stop_grace_s = port_attempts, stop_grace_s
        self._args = ["--model-path", os.path.abspath(model_path), "--dtype", dtype, "--host", host,
                      "--max-total-tokens", str(max_total_tokens), "--disable-overlap-schedule", *extra_args]
        if trust_remote_code:  # SGLang runs code shipped with the model only when asked (model.trust_remote_code)
            self._args.append("--trust-remote-code")
        # not the launcher's rendezvous: under torchrun the server would otherwise read RANK/WORLD_SIZE/MASTER_* and
        # wait in its own torch.distributed init for ranks that never come (measured: a hang at "Init parallel")
        self.env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
        if not cuda:
            # --sleep-on-idle: an idle CPU server's scheduler otherwise busy-waits on a whole core (measured 1.01
            # cores idle, 0.02 with it), which the trainer and a weight sync on the same machine then lack: with it a
            # server's weight load measured 1.5-2.5x faster on the 2-core machine (tools/bench/bench_rollout.py)
            self._args += ["--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle"]
            self.env["SGLANG_USE_CPU_ENGINE"] = "1"
            self.env.setdefault("OMP_NUM_THREADS", "1")
        options = server_options(model_path, cuda)  # what the model's kind adds (a vision-language model's)
        self._launcher = options.launcher or self._launcher
        self._args += options.args
        for key, value in options.env.items():
            self.env.setdefault(key, value)
        self.env["PYTHONPATH"] = ""  # the server's own environment, not the caller's
        self.proc: Optional[subprocess.Popen] = None  # the watchdog
        self.failed = False  # something went wrong: the log is kept
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sglang_server_", suffix=".log", delete=False)
        self._key_file: Optional[str] = None
        self._ready = False  # started and answering as ours
        self._set_port(port or free_port(host))

    def _set_port(self, port: int) -> None:
        self.port = port
        url_host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        self.url = f"http://{f'[{url_host}]' if ':' in url_host else url_host}:{port}"
        self.cmd = [self.python, *self._launcher, *self._args, "--port", str(port)]

    def start(self, timeout: float = 600) -> float:
        """Launch and wait until the server is up and ours; return the seconds it took. Raises RuntimeError with
        the log's tail (and stops what it started) on failure, timeout or interruption."""
        if self.proc is not None:
            raise RuntimeError(f"SGLang server {self.url} is already started")
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
                        f"SGLang server port {self.port} on {self.host} is taken by another process (it was set "
                        f"by the caller, so no other port is tried; log {self.log.name}):\n{self.log_tail()}"
                    ) from None
                if attempt + 1 < self.port_attempts:
                    self._discard()
                    self._set_port(free_port(self.host))
            except BaseException:  # Ctrl-C included: never leave a half-started server behind
                self.failed = True
                self.stop()
                raise
        self.failed = True
        self.stop()
        raise RuntimeError(f"SGLang server: {self.port_attempts} automatically chosen ports were all taken "
                           f"(last {self.port}; log {self.log.name}):\n{self.log_tail()}")

    def _start_once(self, t0: float, deadline: float) -> None:
        if not _port_is_free(self.host, self.port):
            raise PortTakenError(self.port)
        with job_signals_blocked():
            self.proc = subprocess.Popen(
                [self.python, "-I", REAPER, str(os.getpid()), "--grace", str(self.stop_grace_s),
                 "--ignore-job-signals", "--", *self._sheltered(self.cmd), *self._key_args()],
                stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                stdin=subprocess.PIPE,  # stop(): a line on it; a job-wide signal cannot stop the server
                # its own session: Ctrl-C at the terminal and signals to the caller's process group are the
                # caller's to handle (a trainer finishing its step needs its server); the watchdog follows the
                # caller's death
                start_new_session=True)
        _LIVE[id(self)] = self
        _register_atexit()
        register_api_key(self.url, self.api_key)
        while time.time() < deadline:
            if self._bind_failed():
                raise PortTakenError(self.port)
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited with code {self.proc.returncode} while starting "
                                   f"(log {self.log.name}):\n{self.log_tail()}")
            if self._answers_as_ours():
                self._remove_key_file()
                self._ready = True
                return
            time.sleep(1)
        raise RuntimeError(f"SGLang server did not become healthy in {time.time() - t0:.0f} s "
                           f"(log {self.log.name}):\n{self.log_tail()}")

    @staticmethod
    def _sheltered(cmd: Sequence[str]) -> list[str]:
        """`python -m X ...` / `python -c CODE ...` run through ignore_job_signals.py."""
        cmd = list(cmd)
        return [cmd[0], SHELTER, *cmd[1:]] if len(cmd) > 2 and cmd[1] in ("-m", "-c") else cmd

    def _answers_as_ours(self) -> bool:
        if http_status(self.url + "/health", self.api_key) != 200:
            return False
        # /health needs no key; whoever takes ours and refuses another holds our random key: it is our server
        return (http_status(self.url + "/model_info", self.api_key) == 200
                and http_status(self.url + "/model_info", "not-" + self.api_key) == 401
                and self.proc is not None and self.proc.poll() is None)

    def _bind_failed(self) -> bool:
        # uvicorn logs "[Errno 98] error while attempting to bind on address ('127.0.0.1', PORT): address already
        # in use", and SGLang 0.5.23 then hangs instead of exiting (measured) while the port's owner answers /health
        return any("error while attempting to bind" in line and f", {self.port})" in line
                   for line in self.log_tail(200).splitlines())

    def _key_args(self) -> list[str]:
        if "--config" in self._args:  # SGLang takes one config file: the caller's (the key is then visible in ps)
            return ["--api-key", self.api_key]
        fd, self._key_file = tempfile.mkstemp(prefix="sglang_key_", suffix=".yaml")  # mode 0600
        with os.fdopen(fd, "w") as f:
            # the key spelled as the flag: SGLang turns each key into "--" + key
            f.write(f"api-key: {json.dumps(self.api_key)}\n")  # a JSON string is a YAML string
        return ["--config", self._key_file]

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

    def _discard(self) -> None:
        """Stop this attempt's process and start a fresh log for the next one."""
        self.stop(keep_log=False)
        self.failed = False
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sglang_server_", suffix=".log", delete=False)

    def stop(self, keep_log: Optional[bool] = None) -> None:
        """Stop the server and its children (through the watchdog). The log is deleted unless something failed (a
        failed start, a server that had exited by itself) or `keep_log`."""
        proc, ready, self.proc, self._ready = self.proc, self._ready, None, False
        _LIVE.pop(id(self), None)
        self._remove_key_file()
        if proc is not None:
            register_api_key(self.url, None)
            if proc.poll() is not None:  # gone before we asked: a crash, whose log tells why
                self.failed = True
                if ready:  # (a failed start says so in its error)
                    print(f"SGLang server {self.url} had exited with code {proc.returncode}; log {self.log.name}",
                          file=sys.stderr)
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
        if not self.log.closed:
            self.log.close()
        if not (self.failed if keep_log is None else keep_log):
            try:
                os.unlink(self.log.name)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "SGLangServer":
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
