"""MoE router replay (R2 / R3): the engine's routes, carried to megatron, make the trainer's log-probs of the
engine's samples the engine's own on a router close to ties; without them they differ. Also the routes' record in
the in-process engine, their carriage (batch ops, JSON, SGLang's format) and the config's refusals."""
from __future__ import annotations

import base64

import pytest
import torch

from megappo.models.batch import ModelBatch
from megappo.models.router_replay import batch_routes, distinct, routes_from_json, routes_to_json
from megappo.testing.dist import run_distributed
from megappo.testing.moe_ties import engine_vs_trainer, make_tied_moe, route_differences, tie_prompts

torch.set_num_threads(1)


def _one_family(rank, world_size, hf_dir, dense_dir, prompts, micro_kw):
    """The engine-vs-trainer check (`engine_vs_trainer`); and a dense model's chunks get no replay."""
    from megappo.models import router_replay
    from megappo.models.builder import build_model
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    from types import SimpleNamespace

    from megappo.trainer.replay import Replay

    out = engine_vs_trainer(rank, world_size, hf_dir, prompts, {}, micro_kw)
    dense = None
    if dense_dir:
        plat = detect_platform()
        ps = init_parallel(ParallelLayout(), plat, seed=0)
        chunks = build_model(dense_dir, "actor", ps, plat, seed=0)
        dense = router_replay.install(chunks)
        try:
            Replay("R3", SimpleNamespace(actor=SimpleNamespace(chunks=chunks), ref=None))
        except ValueError as e:
            dense = (dense, str(e))
        destroy_parallel()
    return out, dense


# qwen3_moe: padded micro-batches of 2; qwen2_moe (a shared expert, softmax before the top-k): one packed dynamic
# micro-batch
@pytest.mark.parametrize("family, micro_kw", [
    ("qwen3_moe", {"micro_batch_size": 2}),
    ("qwen2_moe", {"use_dynamic_bsz": True, "max_token_len": 256, "packed": True})])
def test_replayed_log_probs_equal_the_engines_and_free_routing_does_not(tmp_path, hf_model_dir, family, micro_kw):
    hf_dir = make_tied_moe(family, str(tmp_path / family))
    dense_dir = hf_model_dir("qwen2") if family == "qwen3_moe" else None
    ((out, dense),) = run_distributed(_one_family, 1, hf_dir, dense_dir, tie_prompts(), micro_kw, timeout=300)
    if dense is not None:  # a dense model has no routers to replay: the trainer refuses, naming the fix
        assert dense[0] == [] and "dense model" in dense[1] and "router_replay.mode=disabled" in dense[1]
    m = out["mask"].bool()
    replayed = (out["replayed"] - out["engine"]).abs()[m].max().item()
    free = (out["free"] - out["engine"]).abs()[m].max().item()
    routes, tokens, total = route_differences(out)
    print(f"{family}: replayed {replayed:.2e}, free {free:.2e}; {routes}/{total} routes on {tokens} tokens "
          f"differ; agreement {out['agree']}/{out['total']}")
    assert replayed <= 1e-5
    assert (out["r2"] - out["free"]).abs()[m].max().item() <= 1e-6  # R2: its own routes replayed
    assert free > 1e-3 and 3 <= routes < total // 4 and tokens >= 3
    assert out["total"] == total and out["agree"] < out["total"]  # agreement counts every valid route once


def test_engine_records_prompt_and_response_routes_but_the_last_token(hf_model_dir):
    """Each completion's routes cover P + R - 1 tokens in every MoE layer; the prompt's equal a plain transformers
    forward's gate choices; a request that does not ask, or a dense model, gets none."""
    import transformers

    from megappo.rollout import HFEngine, SamplingParams
    from megappo.rollout.hf.routing import moe_gates

    hf_dir = hf_model_dir("qwen3_moe")
    engine = HFEngine(hf_dir)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1, return_routed_experts=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    done = [c for g in engine.generate(prompts, params) for c in g]
    for prompt, c in zip(prompts, done):
        r = c.routed_experts
        assert r.dtype == torch.uint8 and tuple(r.shape) == (len(prompt) + len(c.output_ids) - 1, 4, 2)
        assert bool(distinct(r.long()).all())
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    seen = []
    hooks = [g.register_forward_hook(lambda m, a, o: seen.append(o[2])) for g in moe_gates(model)]
    with torch.no_grad():
        model(torch.tensor([prompts[1]]))
    for h in hooks:
        h.remove()
    assert torch.equal(torch.stack(seen, 1).to(torch.uint8), done[1].routed_experts[:len(prompts[1])])
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=3, temperature=0))
    assert all(c.routed_experts is None for g in plain for c in g)
    assert HFEngine(hf_model_dir("qwen2")).routes is None


def test_routes_travel_with_the_tokens_through_batch_ops_and_json():
    from megappo.trainer.experience import Samples

    prompts, responses = [[1, 2, 3], [4]], [[5, 6], [7, 8, 9]]
    routes = [torch.randint(0, 200, (len(p) + len(r) - 1, 3, 2), dtype=torch.uint8) for p, r in zip(prompts, responses)]
    b = ModelBatch.from_token_lists(prompts, responses, pad_token_id=0)
    b.routes = batch_routes(routes, b)
    assert tuple(b.routes.shape) == (2, 6, 3, 2)
    assert torch.equal(b.routes[1, 2:5], routes[1]) and not b.routes[1, :2].any() and not b.routes[1, 5].any()
    assert torch.equal(b.select([1]).routes[0], b.routes[1])
    cropped = b.crop(2, 2)
    assert torch.equal(cropped.routes, b.routes[:, 1:5])
    grown = b.pad_to(3, 4, 4)
    assert tuple(grown.routes.shape) == (3, 8, 3, 2) and torch.equal(grown.routes[:2, 1:7], b.routes)
    wide = torch.randint(0, 300, (4, 2, 2)).to(torch.int16)
    for r in (routes[0], wide, None):
        back = routes_from_json(routes_to_json(r))
        assert (back is None and r is None) or (back.dtype == r.dtype and torch.equal(back, r))
    s = Samples([[1]], [[2]], [[-1.0]], [False], [0], ["d"], [None], [{}], [0], [0], [False], routed_experts=[wide])
    assert torch.equal(Samples(**s.to_json()).routed_experts[0], wide)
    assert Samples.concat([s, s.select([0])]).routed_experts[1] is wide


def test_sglang_routed_experts_format_decodes_to_the_moe_layers(tmp_path):
    """SGLang 0.5.23 returns base64 of int32 [tokens, num_hidden_layers, k] (every decoder layer); the client keeps
    the MoE layers (here layer 0 is dense: mlp_only_layers=[0]) as uint8."""
    from megappo.rollout.sglang.routing import RouteLayout, decode_routed_experts
    from megappo.testing.hf_models import make_hf_model

    d = make_hf_model("qwen3_moe", str(tmp_path / "m"), mlp_only_layers=[0], tokenizer=False)
    layout = RouteLayout.of(d)
    assert layout == RouteLayout((False, True, True, True), 2, 4)
    ids = torch.randint(0, 4, (7, 4, 2), dtype=torch.int32)
    b64 = base64.b64encode(ids.numpy().tobytes()).decode("utf-8")  # the detokenizer's encoding
    got = decode_routed_experts(b64, layout)
    assert got.dtype == torch.uint8 and torch.equal(got.long(), ids[:, 1:].long())
    with pytest.raises(ValueError, match=r"not \[tokens, 4 layers"):
        decode_routed_experts(base64.b64encode(ids.numpy().tobytes()[:12]).decode(), layout)
    ids[3, 2, 1] = 4  # an expert this 4-expert model does not have
    with pytest.raises(ValueError, match=r"\.\.4 of a model with 4:"):
        decode_routed_experts(base64.b64encode(ids.numpy().tobytes()).decode("utf-8"), layout)


def _fake_sglang(answer_routes: bool):
    """A /generate server answering SGLang 0.5.23's shape (two rows, int32 routed_experts in base64 when asked);
    returns (url, the request bodies it got, the routes it sent, its shutdown)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies, sent = [], []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            rows = []
            for ids in body["input_ids"]:
                meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-1.0, 7, None]] * 2}
                if answer_routes and body.get("return_routed_experts"):
                    r = torch.randint(0, 4, (len(ids) + 1, 4, 2), dtype=torch.int32)  # prompt + 2 outputs - 1
                    sent.append(r)
                    meta["routed_experts"] = base64.b64encode(r.numpy().tobytes()).decode("utf-8")
                rows.append({"output_ids": [7, 7], "meta_info": meta})
            data = json.dumps(rows).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", bodies, sent, server.shutdown


@pytest.mark.parametrize("answers", [True, False])
def test_sglang_client_asks_for_and_reads_routed_experts(tmp_path, answers):
    from megappo.rollout import SamplingParams
    from megappo.rollout.sglang.engine import SGLangEngine
    from megappo.rollout.sglang.routing import RouteLayout

    layout = RouteLayout((True,) * 4, 2, 4)
    url, bodies, sent, stop = _fake_sglang(answers)
    try:
        engine = SGLangEngine(url, routes=layout)
        params = SamplingParams(max_new_tokens=2, return_routed_experts=True)
        if not answers:
            with pytest.raises(RuntimeError, match="--enable-return-routed-experts"):
                engine.generate([[1, 2, 3], [4]], params)
            return
        done = [c for g in engine.generate([[1, 2, 3], [4]], params) for c in g]
        plain = engine.generate([[1]], SamplingParams(max_new_tokens=2))
    finally:
        stop()
    assert bodies[0]["return_routed_experts"] is True and "return_routed_experts" not in bodies[1]
    for c, r in zip(done, sent):
        assert c.routed_experts.dtype == torch.uint8 and torch.equal(c.routed_experts.long(), r.long())
    assert plain[0][0].routed_experts is None


def test_a_continued_generation_keeps_the_routes_each_token_was_sampled_with():
    """async_training.partial_rollout: the first request's routes up to its last token, the continuation's after."""
    from megappo.rollout.partial import _joined_routes
    from megappo.rollout.sampling import Completion

    first = Completion(0, [7, 8], [-1.0, -1.0], "abort", routed_experts=torch.zeros((4, 2, 2), dtype=torch.uint8))
    tail = Completion(0, [9], [-1.0], "stop", routed_experts=torch.ones((5, 2, 2), dtype=torch.uint8))
    joined = _joined_routes(first, tail, prompt_len=3)  # prompt 3 + 3 response tokens - 1
    assert joined.shape[0] == 5 and not joined[:4].any() and bool(joined[4].all())


def test_config_refuses_replay_it_cannot_do():
    from megappo.checks import validate
    from megappo.config import ConfigError, load_config

    key = "actor_rollout_ref.actor.megatron.router_replay.mode"
    with pytest.raises(ConfigError, match="enable_rollout_routing_replay=true"):
        validate(load_config(None, [f"{key}=R3"]), world_size=1, check_files=False)
    with pytest.raises(ConfigError, match="set it to disabled and set"):
        validate(load_config(None, ["actor_rollout_ref.ref.megatron.router_replay.mode=R2"]), world_size=1,
                 check_files=False)
    with pytest.raises(ConfigError, match="R2"):
        load_config(None, [f"{key}=R4"])
    with pytest.raises(ConfigError, match="bypass_mode skips"):
        validate(load_config(None, [f"{key}=R2", "algorithm.rollout_correction.bypass_mode=true"]), world_size=1,
                 check_files=False)
    cfg = load_config(None, [f"{key}=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"])
    from megappo.trainer import settings

    assert settings.sampling(cfg).return_routed_experts and not settings.sampling(cfg, validate=True).return_routed_experts
