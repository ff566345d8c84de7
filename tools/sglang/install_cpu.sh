#!/usr/bin/env bash
# Build a virtual environment in which a real SGLang 0.5.23 server runs on a CPU-only x86 machine without AMX
# (measured: 1-2 minutes from PyPI, 2.8 GB). GPU machines use a plain `pip install "megappo[sglang]"` instead.
#
#   bash tools/sglang/install_cpu.sh VENV      # then: VENV/bin/python tools/sglang/check.py --hf HF_DIR
#
# It ends by printing the override that points the trainer's servers at it
# (actor_rollout_ref.rollout.server_python=VENV/bin/python, absolute) and the `megappo rollout-server --python`.
#
# Why each step (see also the SGLang notes in the project's shared notes):
# - torch 2.13.0+cpu first; every other package with --no-deps, because sglang pins a CUDA torch 2.14.1 that
#   would otherwise replace it (sglang runs on 2.13.0).
# - triton: sglang imports it at import time (a CPU-only import works).
# - sgl_kernel: the real package is CUDA/AMX-only; on a CPU without AMX sglang's layers fall back to native torch,
#   so a stand-in whose functions raise NotImplementedError is enough (sgl_kernel_stub.py; never called in the
#   checks run here).
# - torchvision: the server imports it through its multimodal utilities; the PyPI wheel's C extension links CUDA,
#   so its operator registrations are skipped when the extension does not load (patch_torchvision.py).
set -euo pipefail
venv=${1:?usage: install_cpu.sh VENV}
here=$(cd "$(dirname "$0")" && pwd)
python3.11 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q --no-deps -r "$here/requirements-cpu.txt"
"$venv/bin/pip" install -q --no-deps torchvision==0.28.0
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/sgl_kernel"
cp "$here/sgl_kernel_stub.py" "$site/sgl_kernel/__init__.py"
"$venv/bin/python" "$here/patch_torchvision.py" "$site"
"$venv/bin/python" -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
py=$(cd "$venv" && pwd)/bin/python
echo "SGLang server python: $py; use it with"
echo "  megappo train ... actor_rollout_ref.rollout.name=sglang actor_rollout_ref.rollout.server_python=$py"
echo "  megappo rollout-server --python $py ..."
