# megappo's GPU image for clusters (Slurm: launch/slurm/, Ray: launch/ray/cluster.yaml): CUDA 13.0 and exact versions
# of torch, megatron-core, transformer-engine, apex, SGLang, sglang-router, megappo's own dependencies and megappo,
# so every node of a job runs the same stack. Each pin lies inside setup.py's ranges for this Python
# (tests/unit/test_dockerfile.py checks that, and that nothing is left unpinned). For CPU-only use, the README's two
# commands need no container.
#
#   docker build -t megappo:0.1.0 .
#   docker run --gpus all --ipc=host --rm megappo:0.1.0 train --config recipes/cpu/tiny_ppo.yaml trainer.device=cuda
#
# The build needs PyPI and github.com (apex) and compiles transformer-engine's PyTorch extension and apex: about an
# hour on 16 cores (MAX_JOBS and TORCH_CUDA_ARCH_LIST trade time for GPU generations).
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

# torch's PyPI wheels are built for CUDA 13.0, the toolkit above: transformer-engine and apex compile against both.
# SGLang 0.5.23 requires exactly torch 2.14.1 (and transformers 5.19.0), which is why those two are what they are.
ARG PYTHON_VERSION=3.12
ARG TORCH_VERSION=2.14.1
# setup.py: megatron-core 0.16.1 on Python < 3.12, >=0.16.1,<0.20 from 3.12 on: 0.16.1 is inside both
ARG MEGATRON_CORE_VERSION=0.16.1
# megatron-core 0.16.1 is tested with transformer-engine >=2.9,<2.12; core_cu13: its CUDA 13 libraries
ARG TRANSFORMER_ENGINE_VERSION=2.11.0
# apex is not on PyPI (the PyPI "apex" is an unrelated project): NVIDIA/apex at tag 25.09, by commit, since the
# project re-tags; its setup.py knows CUDA 13
ARG APEX_COMMIT=4bdecd06b3c4b2c0a8fb6603829a8f9f05a42b49
ARG SGLANG_VERSION=0.5.23
ARG SGLANG_ROUTER_VERSION=0.3.2
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0;10.0"
ARG MAX_JOBS=8

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false \
    RAY_USAGE_STATS_ENABLED=0 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    MAX_JOBS=${MAX_JOBS} \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

RUN apt-get update \
 && apt-get install -y --no-install-recommends python${PYTHON_VERSION} python${PYTHON_VERSION}-dev \
      python${PYTHON_VERSION}-venv git build-essential ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python${PYTHON_VERSION} -m venv /opt/venv

# Every version the resolver could otherwise choose differently on another day: the stack above, megappo's own
# requirements (setup.py), and the build tools of the extensions compiled below. Every later install takes it as
# constraints, so nothing can move torch or the others. numpy stays below 2.4: SGLang's mistral-common requires that
# on Python <= 3.12. (This set, minus the two compiled packages, resolves for cp312 x86-64: checked with
# `pip install --dry-run --only-binary=:all: --python-version 3.12 ...`.)
RUN printf '%s\n' \
      "torch==${TORCH_VERSION}" \
      "megatron-core==${MEGATRON_CORE_VERSION}" \
      "transformer-engine==${TRANSFORMER_ENGINE_VERSION}" \
      "sglang==${SGLANG_VERSION}" \
      "sglang-router==${SGLANG_ROUTER_VERSION}" \
      "transformers==5.19.0" \
      "tokenizers==0.23.2" \
      "numpy==2.3.5" \
      "packaging==26.4" \
      "safetensors==0.8.0" \
      "pyarrow==26.0.1" \
      "tensorboard==2.21.0" \
      "omegaconf==2.4.0" \
      "PyYAML==6.0.4" \
      "ray==2.60.0" \
      "tqdm==4.70.1" \
      "psutil==7.2.2" \
      "pytest==9.2.0" \
      "pytest-timeout==2.4.0" \
      "pytest-xdist==3.8.0" \
      "peft==0.21.2" \
      "openai==3.63.0" \
      "mkdocs==1.6.1" \
      "pip==26.3" \
      "setuptools==84.2.1" \
      "wheel==0.48.0" \
      "ninja==1.13.2" \
      "pybind11==3.1.0" \
      > /opt/constraints.txt

RUN pip install -c /opt/constraints.txt pip==26.3 setuptools==84.2.1 wheel==0.48.0 ninja==1.13.2 pybind11==3.1.0 \
 && pip install -c /opt/constraints.txt torch==${TORCH_VERSION} megatron-core==${MEGATRON_CORE_VERSION}

# Both compile against the torch above, so no build isolation (it would build against the newest torch instead).
RUN pip install -c /opt/constraints.txt --no-build-isolation \
      "transformer-engine[pytorch,core_cu13]==${TRANSFORMER_ENGINE_VERSION}"
RUN APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install -c /opt/constraints.txt --no-build-isolation \
      "apex @ git+https://github.com/NVIDIA/apex.git@${APEX_COMMIT}"

# rollout.name=sglang, and rollout.router=sglang beside it
RUN pip install -c /opt/constraints.txt sglang==${SGLANG_VERSION} sglang-router==${SGLANG_ROUTER_VERSION}

WORKDIR /opt/megappo
COPY setup.py README.md ./
COPY megappo ./megappo
COPY recipes ./recipes
COPY launch ./launch
COPY tools ./tools
COPY tests ./tests
COPY pytest.ini mkdocs.yml ./
COPY docs ./docs

# megappo from this source (not editable: the image is a release) with its extras' requirements. Then: every pin
# held (a later install could only have failed, not moved one: checked rather than trusted), the parts that import
# without a GPU do (the build has none), and the full list of what was installed, for whoever audits a node.
RUN pip install -c /opt/constraints.txt ".[sglang,test]" \
 && pip check \
 && python -c "import sys; from importlib.metadata import version; \
pins = [l.split('==') for l in open('/opt/constraints.txt').read().split()]; \
bad = [(n, v, version(n)) for n, v in pins if version(n) != v]; \
sys.exit(f'pins not held: {bad}' if bad else 0)" \
 && python -c "import apex, megatron.core, megappo, sglang_router, torch; assert torch.version.cuda == '13.0'" \
 && pip freeze > /opt/megappo/requirements.lock

ENTRYPOINT ["megappo"]
CMD ["--help"]
