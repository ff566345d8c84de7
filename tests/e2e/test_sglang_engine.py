"""`SGLangEngine` against a real SGLang server: the same completions as the in-process `HFEngine` on the same
weights (greedy tokens and log-probs), sampling with `n`, stop tokens, and a weight reload that
makes the server generate what an engine on the new weights generates."""
from __future__ import annotations

import pytest

from megappo.rollout import HFEngine, SamplingParams
from megappo.rollout.sglang.engine import SGLangEngine
from megappo.rollout.sglang.server import SGLangServer
from megappo.testing.completions import assert_same_completions

pytestmark = [pytest.mark.e2e, pytest.mark.sglang]
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)


@pytest.mark.long  # the fleet test compares greedy tokens with the in-process engine too
def test_sglang_engine_generates_what_the_in_process_engine_does(sglang_python, hf_model_dir, tmp_path):
    from megappo.testing.hf_models import make_hf_model

    hf_dir = hf_model_dir("qwen2")
    new = make_hf_model("qwen2", str(tmp_path / "new"), seed=1)
    with SGLangServer(hf_dir, python=sglang_python) as server:
        engine = SGLangEngine(server.url)
        assert_same_completions(engine.generate(PROMPTS, GREEDY), HFEngine(hf_dir).generate(PROMPTS, GREEDY))

        sampled = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, ignore_eos=True)
        a = engine.generate(PROMPTS, sampled)
        assert [len(g) for g in a] == [2, 2, 2] and all(c.prompt_index == i for i, g in enumerate(a) for c in g)
        assert all(len(c.output_ids) == len(c.log_probs) == 6 for g in a for c in g)

        first = engine.generate(PROMPTS[:1], GREEDY)[0][0]
        stop = first.output_ids[3]
        until_stop = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(stop,))
        cut = engine.generate(PROMPTS[:1], until_stop)
        assert cut[0][0].finish_reason == "stop" and cut[0][0].output_ids[-1] in (stop, *HFEngine(hf_dir).eos_ids)
        assert_same_completions(cut, HFEngine(hf_dir).generate(PROMPTS[:1], until_stop))

        assert engine.update_weights_from_disk(new) == 1
        got = engine.generate(PROMPTS, GREEDY)
        assert all(c.weight_version == 1 for g in got for c in g)
        assert_same_completions(got, HFEngine(new).generate(PROMPTS, GREEDY))


# long (~40 s): a megatron actor's export streamed into a server is tests/e2e/test_vllm_weight_sync.py's (the export
# and the weight group are engine-neutral); SGLang's streamed sync is tests/e2e/test_sglang_fleet.py's
@pytest.mark.long
def test_weights_stream_from_a_megatron_actor_into_sglang(sglang_python, hf_model_dir, tmp_path):
    """The trainer's sync: a megatron actor's `iter_hf_weights` buckets, broadcast over a gloo group that the
    server's ranks joined, replace the server's (other) weights; it then generates what HFEngine does on the actor's
    weights."""
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import iter_hf_weights, load_hf_weights
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.testing.hf_models import make_hf_model

    actor_dir = hf_model_dir("qwen2")
    stale = make_hf_model("qwen2", str(tmp_path / "stale"), seed=4)
    plat = detect_platform()
    ps = init_parallel(ParallelLayout(), plat, seed=0)
    try:
        actor = build_model(actor_dir, "actor", ps, plat)
        load_hf_weights(actor, actor_dir, ps)
        with SGLangServer(stale, python=sglang_python) as server:
            engine = SGLangEngine(server.url)
            # views of the parameters, as RolloutWorker.sync_weights exports for a broadcast
            buckets = iter_hf_weights(actor, ps, load_hf_config_dict(actor_dir), bucket_bytes=256 << 10, copy=False)
            assert engine.update_weights(buckets, version=5) == 5
            got = engine.generate(PROMPTS, GREEDY)
            engine.close_weight_group()
    finally:
        destroy_parallel()
    assert all(c.weight_version == 5 for g in got for c in g)
    assert_same_completions(got, HFEngine(actor_dir).generate(PROMPTS, GREEDY))
