"""megappo.algos.estimators / policy_losses / aggregate_loss agree with verl 0.9.1's own outputs.

The cases in tests/data/verl_0_9_1/core_algos_cases.pt were written by tools/verl_reference/core_algos_cases.py
running verl 0.9.1's core_algos.py; nothing here needs verl or a network.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megappo import algos
from megappo.algos import estimators as est
from megappo.algos import policy_losses as pl

torch.set_num_threads(1)

DATA = torch.load(Path(__file__).resolve().parents[1] / "data" / "verl_0_9_1" / "core_algos_cases.pt",
                  weights_only=False)
TOL = dict(rtol=1e-6, atol=1e-6)


def _builtin(registry: dict, package: str) -> set[str]:
    """The names megappo itself registers (a test may have registered a user's file's functions too)."""
    return {name for name, entry in registry.items()
            if getattr(getattr(entry, "fn", entry), "__module__", "").startswith(package)}


def test_cases_cover_every_name():
    assert DATA["verl_version"] == "0.9.1"
    assert {c["name"] for c in DATA["estimator_cases"]} == _builtin(est.ADV_ESTIMATORS, "megappo.algos")
    assert {c["mode"] for c in DATA["loss_cases"]} == _builtin(pl.POLICY_LOSSES, "megappo.algos")
    assert {c["agg"] for c in DATA["loss_cases"]} == set(algos.AGG_MODES)


def _params(algo: dict, extra: dict | None = None) -> est.EstimatorParams:
    weights = (extra or {}).get("weights")
    return est.EstimatorParams(gamma=algo.get("gamma", 1.0), lam=algo.get("lam", 1.0),
                               norm_adv_by_std_in_grpo=algo.get("norm_adv_by_std_in_grpo", True),
                               gdpo_reward_weights=tuple(weights) if weights else None)


@pytest.mark.parametrize("i", range(len(DATA["estimator_cases"])),
                         ids=lambda i: "{name}-in{input}-{g}{algo}".format(
                             **DATA["estimator_cases"][i], g=len(set(DATA["estimator_cases"][i]["groups"]))))
def test_estimator_matches_verl(i):
    case = DATA["estimator_cases"][i]
    extra = case.get("extra")
    inp = DATA["estimator_inputs" if extra is None else "otb_inputs"][case["input"]]
    spec = est.get_adv_estimator(case["name"])
    mask, groups, p = inp["response_mask"], torch.tensor(case["groups"]), _params(case["algo"], extra)
    run = lambda: est.compute_advantages(  # noqa: E731
        spec, inp["token_rewards"], mask, p, values=inp["values"], baselines=inp["reward_baselines"],
        group_ids=groups, old_log_probs=inp.get("old_log_probs"), sum_pi_squared=inp.get("sum_pi_squared"),
        is_weights=inp["rollout_is_weights"] if (extra or {}).get("is_weights") else None)
    if extra and "components" in extra:  # gdpo's reward components, as verl reads them from non_tensor_batch
        run = lambda: est.outcome_to_tokens(  # noqa: E731
            spec, spec.fn(torch.stack(extra["components"]), groups, mask.sum(-1), p), mask)
    if case["verl_error"]:
        with pytest.raises(ValueError, match="at least 2"):
            run()
        return
    adv, ret = run()
    torch.testing.assert_close(adv, case["advantages"] * mask, **TOL)
    torch.testing.assert_close(ret, case["returns"] * mask, **TOL)


def _loss_params(s: dict) -> pl.PolicyLossParams:
    low = s["clip_ratio_low"] if s["clip_ratio_low"] is not None else s["clip_ratio"]
    high = s["clip_ratio_high"] if s["clip_ratio_high"] is not None else s["clip_ratio"]
    return pl.PolicyLossParams(clip_low=low, clip_high=high, clip_c=s["clip_ratio_c"],
                               clip_cov_ratio=s["clip_cov_ratio"], clip_cov_lb=s["clip_cov_lb"],
                               clip_cov_ub=s["clip_cov_ub"], kl_cov_ratio=s["kl_cov_ratio"],
                               ppo_kl_coef=s["ppo_kl_coef"], tau_pos=s["tau_pos"], tau_neg=s["tau_neg"],
                               norm_length=s["loss_scale_factor"], dro_beta=s["dro_beta"])


@pytest.mark.parametrize("i", range(len(DATA["loss_cases"])), ids=lambda i: "{mode}-{agg}-in{input}-s{settings}{w}".format(
    **DATA["loss_cases"][i], w="-isw" if DATA["loss_cases"][i]["weights"] else ""))
def test_policy_loss_matches_verl(i):
    case = DATA["loss_cases"][i]
    inp = DATA["loss_inputs"][case["input"]]
    log_prob = inp["log_prob"].clone().requires_grad_(True)
    torch.manual_seed(case["seed"])  # clip_cov's draw
    loss, metrics = pl.get_policy_loss(case["mode"])(
        log_prob, inp["old_log_prob"], inp["advantages"], inp["response_mask"],
        _loss_params(DATA["loss_settings"][case["settings"]]), agg_mode=case["agg"],
        is_weights=inp["rollout_is_weights"] if case["weights"] else None)
    loss.backward()
    torch.testing.assert_close(loss.detach(), torch.tensor(case["loss"]), **TOL)
    torch.testing.assert_close(log_prob.grad, case["grad"], **TOL)
    for k, v in case["metrics"].items():
        assert float(metrics[k]) == pytest.approx(v, rel=1e-6, abs=1e-6), k
    assert {"ppo_kl", "pg_clipfrac", "pg_clipfrac_lower"} <= set(metrics)


def test_aggregate_loss_matches_verl():
    for case in DATA["agg_cases"]:
        inp = DATA["loss_inputs"][case["input"]]
        kw = case["kwargs"]
        got = algos.aggregate_loss(inp["log_prob"] * inp["advantages"], inp["response_mask"], case["agg"],
                                   num_tokens=kw.get("batch_num_tokens"), num_seqs=kw.get("global_batch_size"),
                                   norm_length=kw.get("loss_scale_factor"))
        assert float(got) == pytest.approx(case["loss"], rel=1e-6, abs=1e-6), (case["agg"], kw)


def test_dual_clip_tie_splits_the_gradient_as_verl():
    """At ratio == clip_ratio_c (== 1 + clip_ratio_high) with A < 0, verl's torch.min gives half the gradient."""
    ties = [c for c in DATA["loss_cases"] if c["input"] == 2]
    assert {c["agg"] for c in ties} == set(algos.AGG_MODES) and all(c["mode"] == "vanilla" for c in ties)
    inp = DATA["loss_inputs"][2]
    tie = torch.exp(inp["log_prob"] - inp["old_log_prob"]) == 3.0
    half = tie & (inp["advantages"] < 0)
    assert half.any() and (tie & (inp["advantages"] > 0)).any()
    case = next(c for c in ties if c["agg"] == "token-sum")
    log_prob = inp["log_prob"].clone().requires_grad_(True)
    loss, _ = pl.get_policy_loss("vanilla")(log_prob, inp["old_log_prob"], inp["advantages"], inp["response_mask"],
                                            _loss_params(DATA["loss_settings"][2]), agg_mode="token-sum")
    loss.backward()
    full = -inp["advantages"] * 3.0
    torch.testing.assert_close(log_prob.grad[half], 0.5 * full[half])
    torch.testing.assert_close(case["grad"][half], 0.5 * full[half])


def _verl_reinforce_pp_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """verl 0.9.1's compute_reinforce_plus_plus_outcome_advantage return loop, in the rewards' dtype."""
    returns, running = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return returns


@pytest.mark.parametrize("gamma", [1.0, 0.999])
@pytest.mark.parametrize("scale", ["kl", "unit"])
def test_reinforce_pp_returns_are_as_exact_as_float32_allows_on_long_rows(gamma, scale):
    """2,048-token rows (right-padded to random lengths): the float32 returns are the float64 result rounded, each
    within one float32 step of it, and well below the worst error of verl's float32 loop. `kl`: per-token KL
    penalties of ~0.01 and a score at the end, as in training (returns of order 1); `unit`: N(0, 1) token rewards
    (returns of order 50)."""
    gen = torch.Generator().manual_seed(7)
    B, T = 16, 2048
    lengths = torch.randint(T // 2, T + 1, (B,), generator=gen)
    mask = (torch.arange(T) < lengths[:, None]).float()
    rewards = torch.randn(B, T, generator=gen) * (0.01 if scale == "kl" else 1.0)
    if scale == "kl":
        rewards[torch.arange(B), lengths - 1] += torch.rand(B, generator=gen)
    rewards = rewards * mask
    p = est.EstimatorParams(gamma=gamma, lam=1.0, norm_adv_by_std_in_grpo=True, gdpo_reward_weights=None)
    _, returns = est.reinforce_plus_plus(rewards, mask, None, None, p)
    exact = _verl_reinforce_pp_returns(rewards.double(), mask.double(), gamma) * mask
    assert returns.dtype == torch.float32
    error = (returns.double() - exact).abs()
    assert (error <= torch.finfo(torch.float32).eps * exact.abs()).all()  # within one float32 step of the truth
    verl = (_verl_reinforce_pp_returns(rewards, mask, gamma) * mask - exact).abs()
    worst, verl_worst = error.amax(-1).mean().item(), verl.amax(-1).mean().item()
    assert worst < verl_worst / 3, (worst, verl_worst)
    if scale == "kl":
        assert worst < 1e-7
