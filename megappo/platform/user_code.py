"""Python files a user names in a config (a reward function, a tool, an environment, an agent program), imported by
path: one module per file, under a name made from its path (two files both called reward.py do not clash, and a
second import in the same process reuses the module)."""
from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Optional


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


class UserCodeError(ValueError):
    """User code (an agent, an environment, a judge's parser, a reward function, a tool) that cannot be loaded or
    called as megappo calls it; the message says which and the fix. The base of every such error: `megappo train`
    reports them all as input errors (megappo/trainer/user_errors.py), one message and exit 1."""


class MissingUserFile(UserCodeError, FileNotFoundError):
    """The named file does not exist."""


# packages megappo's extras install (setup.py), by the module user code imports
EXTRA_OF_MODULE = {"openai": "agents"}


def install_hint(error: BaseException, named: str = "") -> str:
    """The fix of an import that failed on a missing module (`error` a ModuleNotFoundError naming it), as a
    '; ...' tail for the message; '' for any other failure. `named`: the module the config names, whose own absence
    is a wrong name or path rather than a package to install."""
    if not isinstance(error, ModuleNotFoundError) or not error.name:
        return ""
    top = error.name.split(".")[0]
    if named and (named == error.name or named.startswith(error.name + ".")):
        return (f"; check the name, or put the folder that holds {top} on PYTHONPATH (or name the file: "
                "path/to/file.py:Name)")
    if top in EXTRA_OF_MODULE:
        return f"; install it with `pip install -e \".[{EXTRA_OF_MODULE[top]}]\"` (from megappo's folder)"
    return f"; install the package that provides {top!r} into this python (`{sys.executable} -m pip install {top}`)"


def load_named(target: str, base_dir: Optional[str] = None, where: str = "") -> Any:
    """What `package.module:Name` or `path/to/file.py:Name` names (a relative path from `base_dir`, else the current
    folder); `where`: the config entry that named it, for the messages."""
    where = where or repr(target)
    module_part, sep, name = target.rpartition(":")
    if not sep or not module_part or not name:
        raise UserCodeError(f"{where}: {target!r}: write it as package.module:Name or path/to/file.py:Name")
    if module_part.endswith(".py"):
        path = module_part if os.path.isabs(module_part) else os.path.join(base_dir or os.getcwd(), module_part)
        if not os.path.isfile(path):
            raise MissingUserFile(f"{where}: {target!r}: no file {os.path.abspath(path)} (a relative path is read "
                                  "from the config's folder)")
        try:
            module = import_file(path, "megappo_user_agent")
        except Exception as e:
            hint = install_hint(e) or "; fix that file"
            raise UserCodeError(f"{where}: importing {path} failed: {type(e).__name__}: {e}{hint}") from e
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as e:
            hint = install_hint(e, module_part) or "; install it, or name a file as path/to/file.py:Name"
            raise UserCodeError(f"{where}: cannot import {module_part} ({type(e).__name__}: {e}){hint}") from e
    if not hasattr(module, name):
        near = difflib.get_close_matches(name, [k for k in vars(module) if not k.startswith("_")], n=1)
        raise UserCodeError(f"{where}: {target!r}: no {name} there" + (f"; did you mean {near[0]!r}?" if near else ""))
    return getattr(module, name)
