"""Device, backend, dtype and seeds (`device.py`), the CPU-only adaptation of megatron-core (`cpu_compat.py`) and
the parallel layout with its checks (`layout.py`, pure Python).

The device names load on first use, so `megappo.platform.layout` can be imported without torch.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Platform", "detect_platform", "parse_dtype", "seed_everything"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from megappo.platform import device

        return getattr(device, name)
    raise AttributeError(f"module 'megappo.platform' has no attribute {name!r}")
