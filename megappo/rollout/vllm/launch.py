"""megappo's launcher of a vLLM OpenAI-compatible server, with every path behind the API key:

    VLLM_API_KEY=KEY VLLM_SERVER_DEV_MODE=1 SERVER_PYTHON launch.py --model DIR --port P ...

Run by file path in the server's own python (`VLLMServer`, vllm/server.py, through ignore_job_signals.py): standard
library and vllm only, nothing of megappo.

vLLM's API key middleware (`vllm.entrypoints.serve.middleware.authenticate.AuthenticationMiddleware`) checks the key
only on paths under its `GUARDED_PREFIX` (/v1, /v2, /inference, /cohere); /health and the control endpoints
VLLM_SERVER_DEV_MODE opens (/pause, /resume, /abort_requests, /sleep, /wake_up, /update_weights, and
/collective_rpc, which runs any worker method) would answer anyone who reaches the port. The middleware reads
`GUARDED_PREFIX` when each request comes (`url_path.startswith(GUARDED_PREFIX)`), so setting it to ("/",) before
the app is built guards every path. The server is vLLM's single-process API server
(`vllm.entrypoints.openai.api_server`'s `__main__`: `launchers.api_server.entry.main`), whose app is built in this
process; `vllm serve`'s multi-API-server mode builds its apps in spawned processes, which this patch would not
reach, so it is not used. Without VLLM_API_KEY the middleware is not installed at all: the launcher refuses to
start.
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _HERE:
    del sys.path[0]  # run directly: megappo's sibling modules (server.py, client.py) must not shadow vLLM's imports

EVERY_PATH = ("/",)


def guard_every_path() -> None:
    """Make vLLM's API key middleware check every path (OPTIONS aside, as vLLM has it). Raises SystemExit when this
    vLLM has no such setting (another layout: serving it unguarded is not an option)."""
    try:
        from vllm.entrypoints.serve.middleware import authenticate
    except ImportError as e:
        raise SystemExit(f"megappo vLLM launcher: this vLLM has no vllm.entrypoints.serve.middleware.authenticate "
                         f"({e}); its control endpoints cannot be put behind the API key") from None
    if not isinstance(getattr(authenticate, "GUARDED_PREFIX", None), tuple):
        raise SystemExit("megappo vLLM launcher: vLLM's authenticate module has no GUARDED_PREFIX tuple; its "
                         "control endpoints cannot be put behind the API key")
    authenticate.GUARDED_PREFIX = EVERY_PATH


def main(argv: list[str]) -> int:
    if not os.environ.get("VLLM_API_KEY"):
        print("megappo vLLM launcher: VLLM_API_KEY is not set; vLLM would serve its control endpoints "
              "(/collective_rpc, /update_weights, ...) to anyone who reaches the port", file=sys.stderr)
        return 2
    if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        print("megappo vLLM launcher: the API key goes in VLLM_API_KEY, not on the command line (which every local "
              "user can read)", file=sys.stderr)
        return 2
    guard_every_path()
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    sys.argv = ["vllm.entrypoints.openai.api_server", *argv]
    serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
