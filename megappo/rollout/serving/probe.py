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
                    cpu_venv: str, keyed_path: Optional[str] = None) -> list[str]:
    """Why a run whose `engine` servers megappo starts cannot start them (none: it may): the server python
    (`rollout.server_python`, else this one) must have the engine (`missing(python)` says why not; servers given by
    URL are someone else's), an API key file must hold a key, and each server given by URL must take the key the run
    will send (`key_problems`, asked at `keyed_path`)."""
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
            return problems  # no key to ask the servers with
    if rollout.server_urls and keyed_path:
        problems += key_problems(rollout, keyed_path)
    return problems


def key_problems(rollout: Any, keyed_path: str, timeout: float = 5.0) -> list[str]:
    """Each server of `rollout.server_urls` asked GET `keyed_path` (a path the engine's servers guard with their
    key) with the key the run will send: `rollout.api_key_file`'s, else `rollout.api_key`, else none. A 401 is a
    wrong or missing key, named with the key's config. A server that does not answer (yet) is not a problem here:
    the run waits `server_start_timeout_s` for it. The servers are asked at once, each within `timeout` seconds."""
    from concurrent.futures import ThreadPoolExecutor

    from megappo.rollout.serving.http_client import http_status, read_api_key_file

    key = read_api_key_file(rollout.api_key_file) if rollout.api_key_file else rollout.api_key
    source = ("actor_rollout_ref.rollout.api_key_file" if rollout.api_key_file
              else "actor_rollout_ref.rollout.api_key" if rollout.api_key else None)
    urls = list(rollout.server_urls)
    with ThreadPoolExecutor(max_workers=min(len(urls), 16)) as pool:
        statuses = list(pool.map(lambda url: http_status(url.rstrip("/") + keyed_path, key, timeout), urls))
    problems = []
    for url, status in zip(urls, statuses):
        if status != 401:
            continue
        if source:
            problems.append(f"{source}: the server {url} refuses the key the run would send it ({source}'s: "
                            f"HTTP 401 on {keyed_path}); set {source} to that server's key (`megappo rollout-server` "
                            "writes it in its --url-file)")
        else:
            problems.append(f"actor_rollout_ref.rollout.server_urls: the server {url} wants an API key and the run "
                            f"has none (HTTP 401 on {keyed_path}); set actor_rollout_ref.rollout.api_key_file=FILE (its "
                            "first line the server's key) or actor_rollout_ref.rollout.api_key")
    return problems
