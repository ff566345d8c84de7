"""Whether another environment's python can run an engine's package, asked before anything starts."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import Any, Callable, Optional


@functools.lru_cache(maxsize=None)
def package_missing(python: str, package: str) -> Optional[str]:
    """Why `python` cannot run `package` (None when it can): it does not start, or has no such package.

    Cheap: the package is looked up, not imported (a few hundred milliseconds; the answer is kept per python)."""
    probe = f"import importlib.util, sys; sys.exit(3 if importlib.util.find_spec({package!r}) is None else 0)"
    try:
        # as a server sees it (megappo.rollout.serving.process): this environment, less PYTHONPATH
        done = subprocess.run([python, "-c", probe], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=60, env={**os.environ, "PYTHONPATH": ""})
    except (OSError, subprocess.SubprocessError) as e:
        return f"'{python}' cannot be run ({e})"
    if done.returncode == 3:
        return f"'{python}' has no {package} package (No module named '{package}')"
    if done.returncode:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        return f"'{python}' cannot be run ({tail[0]})"
    return None


def server_problems(rollout: Any, engine: str, missing: Callable[[str], Optional[str]], install: str,
                    cpu_venv: str) -> list[str]:
    """Why a run whose `engine` servers megappo starts cannot start them (none: it may): the server python
    (`rollout.server_python`, else this one) must have the engine (`missing(python)` says why not; servers given by
    URL are someone else's), and an API key file must hold a key."""
    from megappo.rollout.serving.http_client import read_api_key_file

    key, problems = "actor_rollout_ref.rollout.server_python", []
    python = os.path.expanduser(rollout.server_python) if rollout.server_python else sys.executable
    problem = None if rollout.server_urls else missing(python)
    if problem:
        which = key if rollout.server_python else f"{key} (unset: this python)"
        problems.append(f"actor_rollout_ref.rollout.name: {engine} servers would run on {which}, but {problem}; "
                        f"install it there (`{python} -m {install}`), or set {key}=PYTHON to a python that has it "
                        f"(on CPU, `{cpu_venv}` makes one and prints the line to use), or use "
                        "actor_rollout_ref.rollout.name=hf")
    if rollout.api_key_file:
        try:
            read_api_key_file(rollout.api_key_file)
        except ValueError as e:
            problems.append(f"actor_rollout_ref.rollout.api_key_file: {e}")
    return problems
