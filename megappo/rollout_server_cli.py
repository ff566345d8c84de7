"""`megappo rollout-server`: one SGLang or vLLM server for a trainer on other nodes (Slurm/Ray layouts with server
nodes).

Runs one server (`--engine sglang`: `--python -m sglang.launch_server`; `vllm`: vLLM's server through megappo's
launcher and worker extension, as the trainer starts them) for a trainer on other nodes, under megappo's
watchdog (the server dies with this command, whatever kills it). Once the server answers as ours, it writes
`{"url": ..., "api_key": ..., "log": ...}` to `--url-file` (mode 0600, atomically) and waits. The server's log is
kept in `--log-dir` (default: the URL file's folder); give the run's `servers/` folder
(trainer.default_local_dir/servers) and the trainer's errors quote its last lines. SIGTERM or SIGINT stops the
server, removes the URL file and exits 0; a server that dies on its own exits 1 with its log's tail; a --python
without the engine exits 2 before anything starts. The trainer takes the URLs with
`actor_rollout_ref.rollout.server_urls=[...]` and the key with `actor_rollout_ref.rollout.api_key_file=F` (a file
holding it: `--api-key-file F` here, so the key is on no command line; launch/slurm/train_sglang.sbatch does all
three).

Registration imports only argparse.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "rollout-server", help="run one SGLang or vLLM server for a trainer elsewhere and publish its URL and key",
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face directory of the actor's initial weights")
    p.add_argument("--engine", choices=("sglang", "vllm"), default="sglang",
                   help="the engine (the trainer's actor_rollout_ref.rollout.name; default sglang)")
    p.add_argument("--url-file", required=True, help="where to write {url, api_key} once the server is up")
    p.add_argument("--host", default="0.0.0.0",
                   help="address to bind (default all interfaces: trainers on other nodes connect; every request "
                   "needs the API key). The published URL names this host")
    p.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    p.add_argument("--python", default=sys.executable, help="the Python that has the engine (default: this one)")
    p.add_argument("--log-dir", default=None, help="where the server's log is kept (default: the --url-file's "
                   "folder); the trainer's run folder's servers/ lets its errors quote the log")
    p.add_argument("--tp", type=int, default=1, help="the server's tensor parallel size (GPUs)")
    p.add_argument("--dtype", default=None, help="weights dtype (default: bfloat16 on GPU, float32 on CPU)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, help="the server's key (default: a random one, published in the "
                     "file); visible in `ps` to every user: prefer --api-key-file")
    key.add_argument("--api-key-file", default=None, help="a file whose first line is the key")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for a cold start")
    p.add_argument("--trust-remote-code", action="store_true", help="let the engine run code shipped with the model")
    p.add_argument("extra", nargs="*", metavar="-- ENGINE_FLAG",
                   help="further sglang.launch_server or vllm serve flags, after --")
    p.set_defaults(func=run)


def _publish(path: str, record: dict) -> None:
    from megappo.trainer.files import write_atomic

    write_atomic(path, json.dumps(record) + "\n")
    os.chmod(path, 0o600)  # the key is a credential


def run(args: argparse.Namespace) -> int:
    from megappo.rollout.serving.http_client import read_api_key_file

    if args.tp < 1:
        print(f"megappo rollout-server: --tp must be >= 1 (got {args.tp})", file=sys.stderr)
        return 2
    if args.api_key_file:
        try:
            args.api_key = read_api_key_file(args.api_key_file)
        except ValueError as e:
            print(f"megappo rollout-server: --api-key-file: {e}", file=sys.stderr)
            return 2
    # `--python=~/venv/bin/python`: no shell expands that `~`
    args.python, args.url_file = os.path.expanduser(args.python), os.path.expanduser(args.url_file)
    problem = _missing(args)
    if problem:
        print(f"megappo rollout-server: {problem}", file=sys.stderr)
        return 2
    # the URL file's folder now, not after a cold start of minutes
    os.makedirs(os.path.dirname(os.path.abspath(args.url_file)), exist_ok=True)
    server = _server(args, _has_cuda())
    server.keep_log_in(args.log_dir or os.path.dirname(os.path.abspath(os.path.expanduser(args.url_file))))
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum
        raise KeyboardInterrupt  # leaves start() (which then stops what it launched) or the wait below

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    try:
        seconds = server.start(timeout=args.start_timeout)
        _publish(args.url_file, {"url": server.url, "api_key": server.api_key, "pid": os.getpid(),
                                 "log": server.log.name})
        print(f"megappo rollout-server: {server.url} up in {seconds:.0f} s; published in {args.url_file}",
              flush=True)
        while server.proc is not None and server.proc.poll() is None:
            time.sleep(1)
        print(f"megappo rollout-server: the server exited on its own (code {server.proc.returncode}); log tail:\n"
              f"{server.log_tail()}", file=sys.stderr)
        server.failed = True
        return 1
    except KeyboardInterrupt:
        return 0 if stop["signal"] is not None else 130
    except RuntimeError as e:
        print(f"megappo rollout-server: {e}", file=sys.stderr)
        return 1
    finally:
        server.stop()
        try:
            os.unlink(args.url_file)
        except FileNotFoundError:
            pass


def _missing(args: argparse.Namespace) -> str:
    """Why --python cannot run the engine ("" when it can), with what to do."""
    from megappo.rollout.serving.probe import package_missing
    from megappo.rollout.sglang.deploy import SGLANG_CPU_VENV, SGLANG_INSTALL
    from megappo.rollout.vllm.deploy import VLLM_CPU_VENV, VLLM_INSTALL

    install, cpu_venv = (SGLANG_INSTALL, SGLANG_CPU_VENV) if args.engine == "sglang" else (VLLM_INSTALL, VLLM_CPU_VENV)
    problem = package_missing(args.python, args.engine)
    if not problem:
        return ""
    which = "--python" if args.python != sys.executable else "--python (unset: this python)"
    return (f"the server would run on {which}, but {problem}; install it there (`{args.python} -m {install}`), or "
            f"pass --python PYTHON, a python that has it (on CPU, `{cpu_venv}` makes one and prints the line to use)")


def _server(args: argparse.Namespace, cuda: bool):
    """The engine's managed server, as the trainer would start it."""
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.engine == "vllm":
        from megappo.rollout.vllm.server import VLLMServer

        return VLLMServer(args.model, python=args.python, port=args.port, dtype=dtype, tensor_parallel_size=args.tp,
                          trust_remote_code=args.trust_remote_code, cuda=cuda, host=args.host, api_key=args.api_key,
                          extra_args=["--logprobs-mode", "processed_logprobs", *args.extra])
    from megappo.rollout.sglang.server import SGLangServer

    extra = list(args.extra) + (["--tp", str(args.tp)] if args.tp > 1 else [])
    return SGLangServer(args.model, python=args.python, port=args.port, cuda=cuda, dtype=dtype, extra_args=extra,
                        trust_remote_code=args.trust_remote_code, host=args.host, api_key=args.api_key)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
