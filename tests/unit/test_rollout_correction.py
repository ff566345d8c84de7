"""megappo.algos.rollout_correction: agreement with verl 0.9.1 on stored cases, edge cases, the bypass losses.

The cases in tests/data/verl_0_9_1/rollout_corr_cases.pt were written by tools/verl_reference/rollout_corr_cases.py
running verl 0.9.1's own rollout_corr_helper; nothing here needs verl or a network.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from megappo import algos
from megappo.algos.rollout_correction import (
    RS_OPTIONS,
    RolloutCorrection,
    bypass_policy_loss,
    compute_rollout_corr_metrics,
    compute_rollout_correction,
    reinforce_policy_loss,
)
from megappo.config import load_config
from megappo.config.schema import RolloutCorrectionConfig

torch.set_num_threads(1)

CASES_PATH = Path(__file__).resolve().parents[1] / "data" / "verl_0_9_1" / "rollout_corr_cases.pt"
DATA = torch.load(CASES_PATH, weights_only=False)
OFFPOLICY_KEYS = {f"rollout_corr/{k}" for k in (
    "training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
    "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq")}


def _settings(**section) -> RolloutCorrection:
    """The math's settings of a config section with these keys (the schema's defaults for the rest), checked as
    preflight checks them."""
    s = RolloutCorrection(**asdict(RolloutCorrectionConfig(**section)))
    s.check()
    return s


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _recorder(calls: list[torch.Tensor]):
    """A sum_across for one shard alone that records what it was asked to sum."""
    def sum_across(t: torch.Tensor) -> torch.Tensor:
        calls.append(t)
        return t
    return sum_across


def _case_id(i: int) -> str:
    c = DATA["cases"][i]
    s = c["settings"]
    parts = [f"in{c['input']}", str(s.get("rollout_is")), str(s.get("rollout_is_threshold", "")),
             "bn" if s.get("rollout_is_batch_normalize") else "", str(s.get("rollout_rs") or ""),
             "dist" if c["distributed"] else ""]
    return "-".join(p.replace(" ", "").replace(",", "+") for p in parts if p)


def test_cases_are_verl_0_9_1():
    assert DATA["verl_version"] == "0.9.1"
    assert len(DATA["cases"]) > 100 and CASES_PATH.stat().st_size < 300_000
    options = {o.strip() for c in DATA["cases"] for o in (c["settings"].get("rollout_rs") or "").split(",")}
    assert set(RS_OPTIONS) <= options


@pytest.mark.parametrize("index", range(len(DATA["cases"])), ids=_case_id)
def test_matches_verl(index):
    case = DATA["cases"][index]
    inp = DATA["inputs"][case["input"]]
    settings = _settings(**case["settings"])
    weights, mask, metrics = compute_rollout_correction(
        inp["old_log_probs"], inp["rollout_log_probs"], inp["response_mask"], settings,
        sum_across=_identity if case["distributed"] else None)
    if case["verl_error"]:  # verl divides by a zero effective sample size; megappo reports 0
        assert metrics["rollout_corr/rollout_is_eff_sample_size"] == 0.0
        assert torch.all(weights == 0) and all(math.isfinite(v) for v in metrics.values())
        return
    if case["weights"] is None:
        assert weights is None
    else:
        assert weights.dtype == case["weights"].dtype
        torch.testing.assert_close(weights, case["weights"], rtol=1e-6, atol=1e-6)
    assert mask.dtype == case["mask"].dtype and torch.equal(mask, case["mask"])
    assert set(metrics) == set(case["metrics"])
    for key, expected in case["metrics"].items():
        assert metrics[key] == pytest.approx(expected, rel=1e-6, abs=1e-6), key


def _batch(B=4, R=6, seed=0, scale=0.3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    old = -3.0 * torch.rand(B, R, generator=g, dtype=dtype)
    rollout = old - scale * torch.randn(B, R, generator=g, dtype=dtype)
    lengths = torch.tensor([R, R - 2, 1, R - 1][:B])
    mask = (torch.arange(R)[None, :] < lengths[:, None]).long()
    return old, rollout, mask


ALL_ON = [
    dict(rollout_is="token"), dict(rollout_is="sequence", rollout_is_threshold="0.5_5"),
    dict(rollout_is="token", rollout_is_batch_normalize=True),
    dict(rollout_rs="token_k1,seq_sum_k2,seq_mean_k3,seq_max_k2", rollout_rs_threshold="0.5_2.0,1,1,1"),
]


@pytest.mark.parametrize("kw", ALL_ON)
def test_all_masked_row_and_nan_padding(kw):
    old, rollout, mask = _batch()
    mask[1] = 0
    old = torch.where(mask.bool(), old, torch.tensor(float("-inf")))  # what padding may hold
    rollout = torch.where(mask.bool(), rollout, torch.tensor(float("nan")))
    weights, new_mask, metrics = compute_rollout_correction(old, rollout, mask, _settings(**kw))
    assert torch.all(new_mask[1] == 0) and torch.all(new_mask <= mask)
    if weights is not None:
        assert torch.isfinite(weights).all() and torch.all(weights[~mask.bool()] == 0)
    assert metrics and all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("kw", ALL_ON)
def test_no_valid_token_and_zero_length(kw):
    s = _settings(**kw)
    for old, rollout, mask in [(torch.zeros(3, 5), torch.zeros(3, 5), torch.zeros(3, 5, dtype=torch.long)),
                               (torch.zeros(3, 0), torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.bool)),
                               (torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4))]:
        calls: list[torch.Tensor] = []
        weights, new_mask, metrics = compute_rollout_correction(old, rollout, mask, s, sum_across=_recorder(calls))
        assert metrics == {} and torch.equal(new_mask, mask) and new_mask.dtype == mask.dtype
        assert (weights is None) == (s.rollout_is is None)
        if weights is not None:
            assert weights.shape == old.shape and torch.all(weights == 0)
        # an empty data-parallel shard still joins the collective of batch normalisation
        assert len(calls) == int(s.rollout_is_batch_normalize)
        assert compute_rollout_corr_metrics(old, rollout, mask) == {}


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_identical_policies(level):
    old, _, mask = _batch()
    tight = ",".join("1.000001" if o.endswith("k1") else "1e-9" for o in RS_OPTIONS)
    s = _settings(rollout_is=level, rollout_rs=",".join(RS_OPTIONS), rollout_rs_threshold=tight,
                          rollout_is_batch_normalize=True)
    weights, new_mask, m = compute_rollout_correction(old, old.clone(), mask, s)
    assert torch.equal(weights, mask.float()) and torch.equal(new_mask, mask)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0 and m["rollout_corr/rollout_rs_seq_masked_fraction"] == 0
    for key in ("kl", "k3_kl", "log_ppl_diff", "chi2_token", "chi2_seq"):
        assert m[f"rollout_corr/{key}"] == pytest.approx(0.0, abs=1e-6), key
    for key in ("ppl_ratio", "rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_eff_sample_size",
                "rollout_is_batch_norm_factor"):
        assert m[f"rollout_corr/{key}"] == pytest.approx(1.0, abs=1e-6), key
    assert m["rollout_corr/training_ppl"] == pytest.approx(m["rollout_corr/rollout_ppl"])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_log_ratios_stay_finite(level, sign):
    old, rollout, mask = _batch()
    if sign > 0:  # log-ratio ~ +1e4; the trainer finds the tokens unlikely too (perplexity e^100)
        old, rollout = old - 100.0, rollout - 1e4
    else:  # log-ratio ~ -1e4 and a trainer perplexity of e^1e4
        old = old - 1e4
    s = _settings(rollout_is=level, rollout_is_batch_normalize=True,
                          rollout_rs="token_k1,seq_sum_k3,seq_max_k2", rollout_rs_threshold="0.5_2,1,1")
    weights, new_mask, m = compute_rollout_correction(old, rollout, mask, s)
    assert torch.isfinite(weights).all() and all(math.isfinite(v) for v in m.values())
    assert torch.all(new_mask == 0)  # every token rejected
    assert all(math.isfinite(v) for v in compute_rollout_corr_metrics(old, rollout, mask).values())


def test_tis_and_icepop_values():
    old = torch.zeros(1, 4)
    rollout = -torch.log(torch.tensor([[0.25, 1.0, 3.0, 10.0]]))  # ratios 0.25, 1, 3, 10
    mask = torch.ones(1, 4)
    w, _, _ = compute_rollout_correction(old, rollout, mask, _settings(rollout_is="token"))
    torch.testing.assert_close(w, torch.tensor([[0.25, 1.0, 2.0, 2.0]]))
    w, _, m = compute_rollout_correction(old, rollout, mask, _settings(rollout_is="token",
                                                                              rollout_is_threshold="0.5_5"))
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 3.0, 0.0]]))
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(0.5)
    w, _, _ = compute_rollout_correction(old, rollout, mask, _settings(rollout_is="sequence",
                                                                              rollout_is_threshold=100.0))
    torch.testing.assert_close(w, torch.full((1, 4), 7.5))
    # k1 bounds act on -log(ratio) = log(pi_rollout / pi_old): "0.5_5" keeps ratios in [0.2, 2]
    _, keep, _ = compute_rollout_correction(old, rollout, mask, _settings(rollout_rs="token_k1",
                                                                                 rollout_rs_threshold="0.5_5"))
    assert keep.tolist() == [[1.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalisation_across_shards(level):
    """sum_across over two shards gives the whole batch's normalisation (verl's distributed path)."""
    old, rollout, mask = _batch(B=4)
    s = _settings(rollout_is=level, rollout_is_batch_normalize=True)
    whole, _, m = compute_rollout_correction(old, rollout, mask, s, sum_across=_identity)
    partial: list[torch.Tensor] = []
    for sl in (slice(0, 1), slice(1, 4)):
        compute_rollout_correction(old[sl], rollout[sl], mask[sl], s, sum_across=_recorder(partial))
    total = partial[0] + partial[1]
    shards = [compute_rollout_correction(old[sl], rollout[sl], mask[sl], s, sum_across=lambda t: total)[0]
              for sl in (slice(0, 1), slice(1, 4))]
    torch.testing.assert_close(torch.cat(shards), whole)
    assert algos.masked_mean(whole if level == "token" else whole[:, :1], mask.bool() if level == "token"
                             else mask.bool().any(-1, keepdim=True)).item() == pytest.approx(1.0, rel=1e-5)


def test_metrics_only_equals_correction_off():
    old, rollout, mask = _batch()
    weights, new_mask, full = compute_rollout_correction(old, rollout, mask, _settings())
    assert weights is None and torch.equal(new_mask, mask)
    only = compute_rollout_corr_metrics(old, rollout, mask)
    assert set(only) == set(full) == OFFPOLICY_KEYS and only == full
    assert set(compute_rollout_corr_metrics(old, None, mask)) == {"rollout_corr/training_ppl",
                                                                  "rollout_corr/training_log_ppl"}
    half = compute_rollout_corr_metrics(old.bfloat16(), rollout.bfloat16(), mask)
    assert half["rollout_corr/kl"] == pytest.approx(full["rollout_corr/kl"], abs=0.02)


@pytest.mark.parametrize("kw, key, valid", [
    (dict(rollout_is="seq"), "rollout_is", "token, sequence"),
    (dict(rollout_is="token", rollout_is_threshold=None), "rollout_is_threshold", "must be set"),
    (dict(rollout_is="token", rollout_is_threshold=True), "rollout_is_threshold", "lower_upper"),
    (dict(rollout_is="token", rollout_is_threshold="5_0.5"), "rollout_is_threshold", "lower bound"),
    (dict(rollout_is="token", rollout_is_threshold="-1"), "rollout_is_threshold", "positive"),
    (dict(rollout_is="token", rollout_is_threshold="abc"), "rollout_is_threshold", "not a number"),
    (dict(rollout_rs="geometric", rollout_rs_threshold=1.1), "rollout_rs", "seq_mean_k1"),
    (dict(rollout_rs=" , "), "rollout_rs", "token_k1"),
    (dict(rollout_rs="token_k2"), "rollout_rs_threshold", "must be set"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="0.1_0.5"), "rollout_rs_threshold", "single upper"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold=0.5), "rollout_rs_threshold", "lower <= upper"),
    (dict(rollout_rs="token_k1,token_k2,token_k3", rollout_rs_threshold="2,0.1"), "rollout_rs_threshold", "3"),
    (dict(loss_type="grpo"), "loss_type", "ppo_clip, reinforce"),
    (dict(bypass_mode="yes"), "bypass_mode", "true or false"),
    (dict(rollout_is_batch_normalize=1), "rollout_is_batch_normalize", "true or false"),
])
def test_invalid_settings(kw, key, valid):
    with pytest.raises(ValueError) as err:
        _settings(**kw)
    assert f"algorithm.rollout_correction.{key}" in str(err.value) and valid in str(err.value)


def test_settings_defaults_and_mapping():
    s = _settings()
    assert (s.rollout_is, s.rollout_is_threshold, s.rollout_rs, s.bypass_mode, s.loss_type) == (
        None, 2.0, None, False, "ppo_clip")
    assert _settings(rollout_rs="token_k1, seq_mean_k3,token_k1", rollout_rs_threshold=2).rs_specs == (
        ("token_k1", 0.5, 2.0), ("seq_mean_k3", None, 2.0))
    assert _settings(rollout_is_threshold=" 0.5_4 ").is_bounds == (4.0, 0.5)
    with pytest.raises(ValueError, match="algorithm.rollout_correction.rollout_is_treshold"):
        load_config(overrides=["algorithm.rollout_correction.rollout_is_treshold=2.0"])


def test_reinforce_loss_gradient():
    old, rollout, mask = _batch()
    adv = torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    w = torch.rand(old.shape, generator=torch.Generator().manual_seed(2)) * 2
    logp = old.clone().requires_grad_(True)
    loss, metrics = reinforce_policy_loss(logp, rollout, adv, mask, is_weights=w.requires_grad_(True))
    loss.backward()
    m = mask.bool()
    n = m.sum()
    torch.testing.assert_close(loss, -(adv * old * w)[m].sum() / n)
    torch.testing.assert_close(logp.grad, torch.where(m, -adv * w / n, torch.zeros(())))
    assert w.grad is None  # the weights are a change of measure, not part of the objective
    assert metrics["ppo_kl"].item() == pytest.approx((rollout - old)[m].mean().item(), abs=1e-6)


def test_bypass_losses():
    old, rollout, mask = _batch(scale=0.5)
    adv = torch.randn(old.shape, generator=torch.Generator().manual_seed(3))
    rs = dict(rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4")
    s = _settings(bypass_mode=True, loss_type="ppo_clip", rollout_is="token", **rs)
    logp = old.clone().requires_grad_(True)
    loss, metrics = bypass_policy_loss(logp, rollout, adv, mask, s, num_tokens=int(mask.sum()))
    _, eff_mask, corr = compute_rollout_correction(old, rollout, mask, s)
    assert 0 < int(eff_mask.sum()) < int(mask.sum())
    ref, ref_metrics = algos.policy_loss(old, rollout, adv, eff_mask, num_tokens=int(mask.sum()))
    torch.testing.assert_close(loss, ref)  # no IS weights on the PPO ratio, rejected tokens dropped
    assert metrics == {**ref_metrics, **corr}

    s = _settings(bypass_mode=True, loss_type="reinforce", rollout_is="token", **rs)
    logp = old.clone().requires_grad_(True)
    loss, metrics = bypass_policy_loss(logp, rollout, adv, mask, s)
    loss.backward()
    w = torch.exp(old - rollout).clamp(max=2.0)
    n = eff_mask.sum()
    torch.testing.assert_close(logp.grad, torch.where(eff_mask.bool(), -adv * w / n, torch.zeros(())))
    assert "rollout_corr/rollout_is_mean" in metrics and "ppo_kl" in metrics


def _bypass_id(i: int) -> str:
    c = DATA["bypass_cases"][i]
    return f"{c['loss_type']}-{c['agg']}-{c['loss_scale_factor']}-in{c['input']}-{c['correction'].get('rollout_is')}"


@pytest.mark.parametrize("index", range(len(DATA["bypass_cases"])), ids=_bypass_id)
def test_bypass_loss_matches_verl(index):
    """verl's compute_policy_loss_bypass_mode, loss_scale_factor included (the B=1, T=4 example: -4/7 and +4/7)."""
    case = DATA["bypass_cases"][index]
    inp = DATA["bypass_inputs"][case["input"]]
    s = _settings(bypass_mode=True, loss_type=case["loss_type"], **case["correction"])
    logp = inp["log_prob"].clone().requires_grad_(True)
    loss, metrics = bypass_policy_loss(logp, inp["rollout_log_prob"], inp["advantages"], inp["response_mask"], s,
                                       agg_mode=case["agg"], norm_length=case["loss_scale_factor"])
    loss.backward()
    assert float(loss.detach()) == pytest.approx(case["loss"], rel=1e-6, abs=1e-6)
    torch.testing.assert_close(logp.grad, case["grad"], rtol=1e-6, atol=1e-6)
    assert float(metrics["ppo_kl"]) == pytest.approx(case["ppo_kl"], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize("agg", algos.AGG_MODES)
def test_bypass_loss_splits_like_the_batch(loss_type, agg):
    """With the global counts and a constant norm_length, micro-batches cut to their own widths sum to the batch."""
    old, rollout, mask = _batch(B=4, R=6, scale=0.2)
    adv = torch.randn(old.shape, generator=torch.Generator().manual_seed(5))
    s = _settings(bypass_mode=True, loss_type=loss_type, rollout_is="token")
    counts = dict(num_tokens=int(mask.sum()), num_seqs=4, norm_length=6.0, agg_mode=agg)

    def run(rows_per_piece):
        logp = old.clone().requires_grad_(True)
        total = 0.0
        for start in range(0, 4, rows_per_piece):
            rows = slice(start, start + rows_per_piece)
            width = max(int(mask[rows].sum(-1).max()), 1)
            loss, _ = bypass_policy_loss(logp[rows, :width], rollout[rows, :width], adv[rows, :width],
                                         mask[rows, :width], s, **counts)
            loss.backward()
            total += float(loss.detach())
        return total, logp.grad

    whole, grad = run(4)
    for rows in (1, 3):
        part, part_grad = run(rows)
        assert part == pytest.approx(whole, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(part_grad, grad, rtol=1e-5, atol=1e-7)


def test_presets_are_verls():
    from megappo.config.rollout_presets import PRESETS

    assert PRESETS == DATA["presets"] and len(PRESETS) == 19
    assert [c["name"] for c in DATA["preset_cases"]] == list(DATA["presets"])
    for name, fields in PRESETS.items():
        _settings(**fields, preset=name)  # every preset is a valid section
    with pytest.raises(ValueError, match="did you mean 'bypass_pg_is'"):
        load_config(overrides=["algorithm.rollout_correction.preset=bypass_pg_iss"])


@pytest.mark.parametrize("index", range(len(DATA["preset_cases"])), ids=lambda i: DATA["preset_cases"][i]["name"])
def test_preset_runs_as_verls(index):
    """Each preset as verl runs it: a bypass preset's loss and gradient, a decoupled one's weights, mask, metrics."""
    from megappo.config.rollout_presets import PRESETS

    case = DATA["preset_cases"][index]
    s = _settings(**PRESETS[case["name"]], preset=case["name"])
    if s.bypass_mode:
        inp = DATA["bypass_inputs"][2]
        logp = inp["log_prob"].clone().requires_grad_(True)
        loss, metrics = bypass_policy_loss(logp, inp["rollout_log_prob"], inp["advantages"], inp["response_mask"],
                                           s)
        loss.backward()
        assert float(loss.detach()) == pytest.approx(case["loss"], rel=1e-6, abs=1e-6)
        torch.testing.assert_close(logp.grad, case["grad"], rtol=1e-6, atol=1e-6)
        assert float(metrics["ppo_kl"]) == pytest.approx(case["ppo_kl"], rel=1e-6, abs=1e-6)
        return
    inp = DATA["bypass_inputs"][3]
    weights, mask, metrics = compute_rollout_correction(inp["old_log_probs"], inp["rollout_log_probs"],
                                                        inp["response_mask"], s)
    if case["weights"] is None:
        assert weights is None
    else:
        torch.testing.assert_close(weights, case["weights"], rtol=1e-6, atol=1e-6)
    assert torch.equal(mask, case["mask"]) and set(metrics) == set(case["metrics"])
    for key, expected in case["metrics"].items():
        assert metrics[key] == pytest.approx(expected, rel=1e-6, abs=1e-6), key
