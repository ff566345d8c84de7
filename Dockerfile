# GPU image: NVIDIA's PyTorch container brings CUDA, NCCL, transformer-engine and apex, which megappo picks up at
# run time. For CPU-only use, the README's two commands need no container.
ARG BASE=nvcr.io/nvidia/pytorch:25.06-py3
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false \
    RAY_USAGE_STATS_ENABLED=0

WORKDIR /opt/megappo
COPY setup.py README.md ./
COPY megappo ./megappo
COPY recipes ./recipes
COPY launch ./launch
COPY tools ./tools

# Keep the container's own torch (built for its CUDA); megatron-core and the rest come from PyPI.
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/torch-pin.txt \
 && pip install --no-cache-dir -c /tmp/torch-pin.txt -e ".[test]"
# SGLang pins its own torch; install it against the container's (rollout.name=sglang). Optional.
RUN pip install --no-cache-dir -c /tmp/torch-pin.txt "sglang>=0.5.23" \
 || echo "sglang not installed: only rollout.name=hf is available in this image"

ENTRYPOINT ["megappo"]
CMD ["--help"]
