"""File modes as a plain open() or mkdir() would give them, for files written by libraries that choose their own."""
from __future__ import annotations

import os


def umask() -> int:
    """The process's umask (reading it means setting it: it is put straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_if_created(path: str) -> None:
    """Give a file the mode a plain open() would have (0666 less the umask): safetensors' save_file writes 0600."""
    os.chmod(path, 0o666 & ~umask())
