#!/usr/bin/env bash
# The GPU checks, as one prepared script for a lent GPU machine that cannot reach a package index.
#
#   bash tools/gpu_check.sh --fetch   # here (any machine with pip access): wheels of what the GPU image lacks -> .whl/
#   bash tools/gpu_check.sh           # there, with .whl carried: pytest -m gpu, then a CUDA conversion round trip
#
# The GPU image already has torch, transformers, safetensors, tokenizers, pyarrow, tensorboard, PyYAML, tqdm,
# psutil and pytest; megatron-core and omegaconf travel as wheels (Python 3.12, x86-64). transformer-engine's
# wheels are too large to carry, so there the local layer spec runs: NCCL, bf16 and the CUDA platform are covered,
# the TE spec only where the image has TE. SGLang's GPU paths (NCCL and CUDA IPC weight sync, a TP2 server, the
# trainer with a CUDA SGLang rollout: tests/gpu/test_gpu_sglang.py) run where the image has SGLang, in this python
# or in MEGAPPO_SGLANG_PYTHON; elsewhere they are skipped with that reason. vLLM's (tests/gpu/test_gpu_vllm.py: the
# engine colocated in a rank, sleep/wake, in-process weight loads, LoRA requests; a vLLM server megappo starts, its
# key on every path, disk sync, abort with partial tokens, pause/resume) run where the image has vLLM 0.32
# (`megappo[vllm]`), in this python or in MEGAPPO_VLLM_PYTHON for the server. Logs go to $OUT (or /tmp) as
# gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--fetch" ]]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "megatron-core==0.16.1" "omegaconf>=2.3,<2.5"
    ls -la .whl
    exit 0
fi

LOG="${OUT:-/tmp}/gpu_check.log"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
{
    nvidia-smi -L
    python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'megatron-core', m.__version__)"
    python3 -m pytest -m gpu tests/gpu -v -p no:cacheprovider -o addopts=""
    rc=$?
    work=$(mktemp -d)
    for family in qwen2 qwen3_moe; do
        python3 -m megappo.testing model --family "$family" --out "$work/$family" \
        && python3 -m megappo.cli convert hf-to-mcore --hf "$work/$family" --out "$work/$family-mcore" --bucket-size 1MB \
        && python3 -m megappo.cli convert verify --hf "$work/$family" --mcore "$work/$family-mcore" \
        && python3 -m megappo.cli convert mcore-to-hf --mcore "$work/$family-mcore" --out "$work/$family-hf" \
        || rc=1
    done
    echo "gpu_check: exit $rc"
    exit $rc
} 2>&1 | tee "$LOG"
