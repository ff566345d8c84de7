"""A mixture-of-experts policy (Qwen3-MoE) on vLLM's CPU build: served with the in-process engine's tokens and
log-probs; its routed experts (router replay R3) are out of reach on CPU, for the reason the config check gives."""
from __future__ import annotations

import pytest

from megappo.rollout import HFEngine, SamplingParams
from megappo.rollout.vllm.fleet import VLLMFleet
from megappo.rollout.vllm.server import VLLMServer
from megappo.testing.completions import assert_same_completions

# long: a server of its own (~30 s) for each; the dense model's serving is tests/e2e/test_vllm_fleet.py's, the CPU
# refusal of R3 with vLLM tests/unit/test_vllm_config.py's
pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.long]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from megappo.testing.hf_models import make_hf_model

    return make_hf_model("qwen3_moe", str(tmp_path_factory.mktemp("vllm_moe")), head_dim=32)


def test_a_moe_policy_is_served_as_the_in_process_engine_serves_it(vllm_python, moe_dir):
    greedy = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    with VLLMServer(moe_dir, python=vllm_python, cuda=False, dtype="float32", max_model_len=256) as server:
        fleet = VLLMFleet([server.url], api_key=server.api_key)
        assert_same_completions(fleet.generate([[5, 6, 7], [9, 10]], greedy),
                                HFEngine(moe_dir).generate([[5, 6, 7], [9, 10]], greedy))


def test_routed_experts_need_model_runner_v2_which_needs_triton(vllm_python, moe_dir):
    """The measured bound behind the config's refusal (`VLLM_CPU_ROUTES`)."""
    server = VLLMServer(moe_dir, python=vllm_python, cuda=False, dtype="float32", max_model_len=256,
                        extra_args=["--enable-return-routed-experts"])
    with pytest.raises(RuntimeError, match="Model Runner V2 requires Triton"):
        server.start(timeout=300)
