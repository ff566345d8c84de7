"""An SGLang server process: `python -m sglang.launch_server`, started, probed and reaped as every managed server is
(`megappo/rollout/serving/process.py`: the watchdog, port choice, identity check, job signals).

On a machine without CUDA the CPU flags are added (`SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend
torch_native`); tools/sglang/install_cpu.sh builds an environment in which that runs. The API key reaches SGLang in
a 0600 config file, not on the command line.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Optional, Sequence

from megappo.rollout.serving.process import ManagedServer
from megappo.rollout.sglang.vlm import server_options


class SGLangServer(ManagedServer):
    """One `python -m sglang.launch_server` process under a watchdog; a context manager that stops it.

    `port=None` picks a free port (and another one if it turns out to be taken); a given port that is taken is an
    error naming it. `host` is the address the server binds (loopback unless set: other nodes need the cluster
    address, or 0.0.0.0). `api_key=None` makes a random one (`self.api_key`)."""

    ENGINE = "SGLang"
    KEYED_PATH = "/model_info"

    def __init__(self, model_path: str, *, python: str = "python", port: Optional[int] = None, cuda: bool = False,
                 dtype: str = "float32", max_total_tokens: int = 4096, extra_args: Sequence[str] = (),
                 trust_remote_code: bool = False, host: str = "127.0.0.1", api_key: Optional[str] = None,
                 port_attempts: int = 5, stop_grace_s: float = 15.0):
        if api_key is not None and api_key.startswith("-"):
            raise ValueError("an SGLang API key must not start with '-' (SGLang's argument parser takes it for a flag)")
        super().__init__(python=python, port=port, host=host, api_key=api_key, port_attempts=port_attempts,
                         stop_grace_s=stop_grace_s)
        self._launcher = ["-m", "sglang.launch_server"]
        self._args = ["--model-path", os.path.abspath(model_path), "--dtype", dtype, "--host", host,
                      "--max-total-tokens", str(max_total_tokens), "--disable-overlap-schedule", *extra_args]
        if trust_remote_code:  # SGLang runs code shipped with the model only when asked (model.trust_remote_code)
            self._args.append("--trust-remote-code")
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

    def command(self, port: int) -> list[str]:
        return [self.python, *self._launcher, *self._args, "--port", str(port)]

    def key_delivery(self) -> tuple[list[str], dict[str, str]]:
        if "--config" in self._args:  # SGLang takes one config file: the caller's (the key is then visible in ps)
            return ["--api-key", self.api_key], {}
        fd, self._key_file = tempfile.mkstemp(prefix="sglang_key_", suffix=".yaml")  # mode 0600
        with os.fdopen(fd, "w") as f:
            # the key spelled as the flag: SGLang turns each key into "--" + key
            f.write(f"api-key: {json.dumps(self.api_key)}\n")  # a JSON string is a YAML string
        return ["--config", self._key_file], {}
