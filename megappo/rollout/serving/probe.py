"""Whether another environment's python can run an engine's package, asked before anything starts."""
from __future__ import annotations

import functools
import os
import subprocess
from typing import Optional


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
