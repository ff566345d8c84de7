"""Files a killed run must never leave half-written: written beside their place, fsynced, then renamed over it."""
from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """`path` holds either its old content or `text`, whenever the process dies."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def fsync_tree(path: str) -> None:
    """Flush every file and directory under `path` to disk, so the rename that publishes it publishes data."""
    for parent, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(parent)
