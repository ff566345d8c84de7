"""The errors a user fixes by changing an input (the config, a data file, their own code that does not load or has
the wrong signature, a checkpoint to resume from, what preflight finds): `megappo train` prints their message alone
and exits 1. Their traceback helps only whoever debugs megappo itself (or, for user code, shows the line of the
user's file), so it goes to a log file in the run's output directory (named in the message) and to the console with
`--debug`. Any other exception is a bug and keeps its traceback.

Light to import: nothing of megappo is imported here.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Optional

EXIT_ERROR = 1
LOG_FILE = "error.log"  # error.rank<N>.log on the other ranks


# (module, class): the input errors. Only modules already imported are looked at: an error can only come from a
# module that was loaded, and a mistyped key must not wait for torch to load before it is said. UserCodeError is the
# base of every error of the user's own code that does not load or cannot be called as megappo calls it (agents,
# environments, judge parsers, reward functions, tools): each subclasses it, so this entry covers them all.
USER_ERRORS = (
    ("megappo.config.fields", "ConfigError"), ("megappo.data.errors", "DataError"),
    ("megappo.models.checkpoint", "CheckpointError"), ("megappo.models.hf_config", "UnsupportedModelError"),
    ("megappo.platform.layout", "LayoutError"), ("megappo.platform.user_code", "UserCodeError"),
)


def user_error_types() -> tuple[type, ...]:
    found = (getattr(sys.modules.get(module), name, None) for module, name in USER_ERRORS)
    return tuple(t for t in found if isinstance(t, type) and issubclass(t, BaseException))


def is_user_error(e: BaseException) -> bool:
    return isinstance(e, user_error_types())


def write_log(e: BaseException, local_dir: Optional[str]) -> Optional[str]:
    """The traceback of `e` in `<local_dir>/error.log` (this rank's); its path, or None where the directory does
    not exist (an error found before the run made it) or cannot be written."""
    if not local_dir:
        return None
    local_dir = os.path.abspath(os.path.expanduser(local_dir))
    if not os.path.isdir(local_dir):
        return None
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(local_dir, LOG_FILE if rank == 0 else f"error.rank{rank}.log")
    try:
        with open(path, "w") as f:
            f.write("".join(traceback.format_exception(e)))
    except OSError:
        return None
    return path


def report(e: BaseException, local_dir: Optional[str], debug: bool, prog: str = "megappo train") -> int:
    """Print a user error's message (its traceback only with `debug`) and return the exit status, 1."""
    from megappo.trainer.run_lock import DirLocked

    if debug:
        traceback.print_exception(e, file=sys.stderr)
    # a locked directory is another run's: nothing of this one is written there
    log = None if isinstance(e, DirLocked) else write_log(e, local_dir)
    where = f" (traceback: {log}; --debug prints it)" if log and not debug else ""
    print(f"{prog}: {e}{where}", file=sys.stderr, flush=True)
    return EXIT_ERROR
