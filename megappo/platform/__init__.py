"""Device, backend, dtype and seeds (`device.py`) and the CPU-only adaptation of megatron-core (`cpu_compat.py`)."""
from megappo.platform.device import Platform, detect_platform, parse_dtype, seed_everything

__all__ = ["Platform", "detect_platform", "parse_dtype", "seed_everything"]
