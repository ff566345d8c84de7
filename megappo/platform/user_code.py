"""Python files a user names in a config (a reward function, a tool, an environment, an agent program), imported by
path: one module per file, under a name made from its path (two files both called reward.py do not clash, and a
second import in the same process reuses the module)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from types import ModuleType


class NotPython(ValueError):
    """The path names no file Python can import."""


def import_file(path: str, prefix: str = "megappo_user") -> ModuleType:
    """The module of the Python file `path`; NotPython when it cannot be one, else what executing it raised."""
    path = os.path.abspath(path)
    name = f"{prefix}_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise NotPython(f"{path} cannot be imported as Python; name a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
