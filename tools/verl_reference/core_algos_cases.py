"""Record verl 0.9.1's advantage estimators, policy losses and agg_loss on seeded random inputs, for megappo's
agreement test (tests/unit/test_verl_core_algos.py).

    python tools/verl_reference/core_algos_cases.py PATH_TO_VERL [--out tests/data/verl_0_9_1/core_algos_cases.pt]

PATH_TO_VERL is a directory holding the ``verl`` package of release 0.9.1 (a checkout of the v0.9.1 tag, or the
unpacked wheel: ``pip download verl==0.9.1 --no-deps`` and unzip it; the stored file was made from the wheel).

verl's ``verl/trainer/ppo/core_algos.py`` is run as is, loaded with importlib (importing ``verl`` pulls in Ray and
the whole config tree) after ``verl/utils/torch_functional.py`` (masked_mean / masked_whiten). Stand-ins for
imports that carry no numbers go into ``sys.modules`` first: ``tensordict`` / ``transformers`` (annotations),
``verl.utils.device``, ``verl.utils.import_utils.deprecated`` (a no-op decorator), and the config classes
``AlgoConfig`` and ``ActorConfig``: the losses read their settings from an ActorConfig (and assert its type), so
the stand-in is a plain attribute holder of the same name, with ``get`` and an empty ``global_batch_info`` (one
rank, no global counts: verl's single-batch path). ``verl/utils/groupwise.py`` (the vectorized estimators' group
statistics) is verl's own file.

Cases: two input sets (binary outcome scores; continuous scores with per-token rewards), groups of four, three,
one and two, an all-equal group, ties, an empty response; every estimator (grpo_passk on a set without a group
of one, where verl raises), GRPO / pass@k with and without the std, GAE and REINFORCE++ with two (gamma, lam).
Losses: every loss mode x every loss_agg_mode x rollout IS weights off / on x two settings (verl's defaults, and
wider clip-cov / kl-cov fractions, asymmetric clip, other SAPO taus, a loss_scale_factor); each records the loss,
verl's metrics and the gradient with respect to log_prob. clip_cov draws with torch's global generator, seeded with
the case's ``seed`` right before the call. agg_loss alone on every mode, with and without given global counts.

Added after those (recorded in the same run; the first cases above stay as they were, see ``_keep_recorded``):
grpo_vectorized / rloo_vectorized / gdpo called as verl's trainer calls them (no norm_adv_by_std_in_grpo argument;
gdpo with its score as the one component, and with two reward components from ``non_tensor_batch`` and weights);
optimal_token_baseline and tir_optimal_token_baseline with and without rollout IS weights, on both input sets and a
third whose response masks have tool-token holes; dppo_tv, dppo_kl and dro like the other losses; vanilla at an
exact dual-clip tie (ratio == clip_ratio_c == 1 + clip_ratio_high, where torch.min splits the gradient) on a
third loss input.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_corr_cases import _load, _module  # noqa: E402 - verl's files loaded the same way

B, T = 12, 10
GROUPS = [0, 0, 0, 0, 1, 1, 1, 2, 3, 3, 4, 4]  # 4, 3, 1 (alone), 2, 2
PASSK_GROUPS = [0, 0, 0, 0, 1, 1, 1, 3, 3, 3, 4, 4]
ESTIMATORS = ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg",
              "grpo_passk"]
LOSS_MODES = ["vanilla", "gspo", "cispo", "sapo", "clip_cov", "kl_cov", "geo_mean", "gpg"]
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
NEW_ESTIMATORS = ["grpo_vectorized", "rloo_vectorized", "gdpo", "optimal_token_baseline",
                  "tir_optimal_token_baseline"]
NEW_LOSS_MODES = ["dppo_tv", "dppo_kl", "dro"]
LOSS_SETTINGS = [
    dict(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05,
         loss_scale_factor=None, clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0, kl_cov_ratio=0.0002,
         ppo_kl_coef=0.1, dro_beta=0.1),
    dict(clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=2.5, tau_pos=2.0, tau_neg=3.0,
         loss_scale_factor=7, clip_cov_ratio=0.1, clip_cov_lb=0.2, clip_cov_ub=3.0, kl_cov_ratio=0.1,
         ppo_kl_coef=0.5, dro_beta=0.7),
    # the dual-clip tie: 1 + clip_ratio_high == clip_ratio_c
    dict(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=2.0, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05,
         loss_scale_factor=None, clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0, kl_cov_ratio=0.0002,
         ppo_kl_coef=0.1, dro_beta=0.1),
]


class _Config:
    """Attribute holder with DictConfig's `get`."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def get(self, key, default=None):
        return getattr(self, key, default)


class AlgoConfig(_Config):
    pass


class ActorConfig(_Config):
    pass


def load_core_algos(verl_root: Path) -> types.ModuleType:
    pkg = verl_root / "verl"
    version = (pkg / "version" / "version").read_text().strip()
    if version != "0.9.1":
        print(f"warning: {pkg} is verl {version}, not 0.9.1", file=sys.stderr)

    class _Annotation:
        pass

    _module("tensordict", TensorDict=_Annotation)
    _module("transformers", PreTrainedTokenizer=_Annotation)
    for name in ("verl", "verl.utils", "verl.trainer", "verl.trainer.ppo", "verl.workers"):
        _module(name).__path__ = []
    _module("verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: torch.cpu)
    groupwise = _load("verl.utils.groupwise", pkg / "utils" / "groupwise.py")  # the vectorized estimators' helpers
    sys.modules["verl.utils"].__dict__.update(as_torch_index=groupwise.as_torch_index,
                                              group_mean_std=groupwise.group_mean_std)
    _module("verl.utils.import_utils", deprecated=lambda *a, **k: (lambda fn: fn))
    _module("verl.trainer.config", AlgoConfig=AlgoConfig)
    _module("verl.workers.config", ActorConfig=ActorConfig)
    sys.modules["verl.utils"].torch_functional = _load("verl.utils.torch_functional",
                                                       pkg / "utils" / "torch_functional.py")
    return _load("verl.trainer.ppo.core_algos", pkg / "trainer" / "ppo" / "core_algos.py")


def _lengths(g: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[5] = 0  # an empty response, in a group of three
    lengths[0] = T
    return lengths


def estimator_inputs() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(9120)
    out = []
    for binary in (True, False):
        lengths = _lengths(g)
        mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
        if binary:
            scores = (torch.rand(B, generator=g) < 0.5).float()
            scores[4:7] = 1.0  # an all-equal group
            token_rewards = torch.zeros(B, T)
        else:
            scores = torch.randn(B, generator=g)
            scores[8] = scores[9]  # a tie for the best of its group
            token_rewards = 0.05 * torch.randn(B, T, generator=g) * mask
        last = (lengths - 1).clamp(min=0)
        token_rewards[torch.arange(B), last] += scores * (lengths > 0)
        out.append(dict(token_rewards=token_rewards, response_mask=mask, values=torch.randn(B, T, generator=g),
                        reward_baselines=torch.rand(B, generator=g)))
    return out


def loss_inputs() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5150)
    out = []
    for scale in (0.1, 0.6):
        lengths = _lengths(g)
        mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
        old = -3.0 * torch.rand(B, T, generator=g)
        new = old + scale * torch.randn(B, T, generator=g)
        seq_adv = 2.0 * torch.randn(B, 1, generator=g)
        adv = (seq_adv + 0.3 * torch.randn(B, T, generator=g)) * mask
        is_w = torch.exp(0.2 * torch.randn(B, T, generator=g))
        out.append(dict(log_prob=new, old_log_prob=old, advantages=adv, response_mask=mask, rollout_is_weights=is_w))
    return out


def otb_inputs(est_inputs: list[dict]) -> list[dict[str, torch.Tensor]]:
    """Per estimator input: the old policy's token log-probs, sum over the vocabulary of pi^2 (between pi^2 and
    pi^2 + (1 - pi)^2, as for a real distribution), rollout IS weights; and a third input whose masks have
    tool-token holes (multi-turn), with its own rewards."""
    g = torch.Generator().manual_seed(4242)
    out = []
    for inp in est_inputs + [None]:
        if inp is None:
            lengths = _lengths(g)
            mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
            holes = (torch.rand(B, T, generator=g) < 0.3) & (torch.arange(T)[None, :] > 0)
            mask = mask * ~holes
            mask[0] = (torch.arange(T) % 4 != 2).float()  # a long response with regular tool answers
            last = torch.where(mask.bool(), torch.arange(T), torch.zeros(T, dtype=torch.long)).amax(-1)
            rewards = torch.zeros(B, T)
            rewards[torch.arange(B), last] = torch.randn(B, generator=g) * (mask.sum(-1) > 0)
            inp = dict(token_rewards=rewards, response_mask=mask, values=torch.zeros(B, T),
                       reward_baselines=torch.zeros(B))
        pi = 0.05 + 0.9 * torch.rand(B, T, generator=g)
        spp = pi.square() + (1 - pi).square() * torch.rand(B, T, generator=g)
        out.append(dict(inp, old_log_probs=pi.log(), sum_pi_squared=spp,
                        rollout_is_weights=torch.exp(0.3 * torch.randn(B, T, generator=g))))
    return out


def run_new_estimator(ca, inp: dict, name: str, groups: list[int], extra: dict, **algo) -> dict:
    """verl's estimator called as its trainer (ray_trainer.compute_advantage) calls it."""
    config = AlgoConfig(norm_adv_by_std_in_grpo=algo.get("norm_adv_by_std_in_grpo", True),
                        gdpo_reward_keys=extra.get("keys"), gdpo_reward_weights=extra.get("weights"))
    kwargs = dict(token_level_rewards=inp["token_rewards"].clone(), response_mask=inp["response_mask"],
                  config=config, index=groups)
    if name == "gdpo" and "keys" in extra:
        P = 3
        kwargs.update(non_tensor_batch=dict(zip(extra["keys"], [c.numpy() for c in extra["components"]])),
                      batch=dict(prompts=torch.zeros(B, P, dtype=torch.long),
                                 attention_mask=torch.cat([torch.ones(B, P), inp["response_mask"]], dim=1).long()))
    if name.endswith("optimal_token_baseline"):
        kwargs.update(old_log_probs=inp["old_log_probs"], sum_pi_squared=inp["sum_pi_squared"],
                      rollout_is_weights=inp["rollout_is_weights"] if extra.get("is_weights") else None)
    adv, ret = ca.get_adv_estimator_fn(name)(**kwargs)
    return dict(verl_error=None, advantages=adv, returns=ret)


def new_estimator_cases(ca, est_inputs: list[dict]) -> tuple[list[dict], list[dict]]:
    otb_in = otb_inputs(est_inputs)
    g = torch.Generator().manual_seed(77)
    cases = []
    for i, inp in enumerate(otb_in):
        for name in NEW_ESTIMATORS:
            if i == 2 and not name.endswith("optimal_token_baseline"):
                continue
            variants = [dict()]
            if name in ("grpo_vectorized", "gdpo"):
                variants = [dict(norm_adv_by_std_in_grpo=True), dict(norm_adv_by_std_in_grpo=False)]
            extras = [dict()]
            if name == "gdpo":
                comps = [(torch.rand(B, generator=g) < 0.5).float(), torch.randn(B, generator=g)]
                extras = [dict(), dict(keys=["format_reward", "accuracy_reward"], components=comps),
                          dict(keys=["format_reward", "accuracy_reward"], components=comps, weights=[0.3, 1.5])]
            elif name.endswith("optimal_token_baseline"):
                extras = [dict(is_weights=False), dict(is_weights=True)]
            for algo in variants:
                for extra in extras:
                    cases.append(dict(input=i, name=name, algo=algo, groups=list(GROUPS), extra=extra,
                                      **run_new_estimator(ca, inp, name, GROUPS, extra, **algo)))
    return otb_in, cases


def tie_loss_input() -> dict[str, torch.Tensor]:
    """Ratios exactly 3.0 in float32 (the dual-clip bound and 1 + clip_ratio_high of LOSS_SETTINGS[2]) next to
    ordinary ones, with negative and positive advantages."""
    d = torch.tensor(1.0986123, dtype=torch.float32)
    while torch.exp(d) != 3.0:  # the float32 log-ratio whose exp is exactly 3
        d = torch.nextafter(d, torch.tensor(2.0 if torch.exp(d) < 3.0 else 0.0))
    old = torch.tensor([[-1.5, -2.0, -0.7, -3.0], [-1.2, -0.4, -2.5, -1.0]])
    step = torch.tensor([[1.0, 1.0, 0.1, 2.0], [1.0, -0.3, 1.0, 0.0]])
    new = old + torch.where(step == 1.0, d, step)
    adv = torch.tensor([[-1.0, 0.5, -2.0, -0.3], [2.0, -1.0, -0.5, 1.0]])
    return dict(log_prob=new, old_log_prob=old, advantages=adv, response_mask=torch.ones(2, 4),
                rollout_is_weights=torch.ones(2, 4))


def run_estimator(ca, inp: dict, name: str, groups: list[int], **algo) -> dict:
    config = AlgoConfig(gamma=algo.get("gamma", 1.0), lam=algo.get("lam", 1.0),
                        norm_adv_by_std_in_grpo=algo.get("norm_adv_by_std_in_grpo", True))
    rewards = inp["token_rewards"].clone()  # some of verl's estimators write into the scores in place
    try:
        if name == "gae":
            adv, ret = ca.compute_gae_advantage_return(rewards, inp["values"], inp["response_mask"],
                                                       gamma=config.gamma, lam=config.lam)
        elif name == "grpo":
            adv, ret = ca.compute_grpo_outcome_advantage(rewards, inp["response_mask"], index=groups,
                                                         norm_adv_by_std_in_grpo=config.norm_adv_by_std_in_grpo)
        else:
            kwargs = dict(token_level_rewards=rewards, response_mask=inp["response_mask"], config=config,
                          index=groups)
            if name == "remax":
                kwargs["reward_baselines"] = inp["reward_baselines"]
            adv, ret = ca.get_adv_estimator_fn(name)(**kwargs)
    except ValueError as e:
        return dict(verl_error=f"ValueError: {e}", advantages=None, returns=None)
    return dict(verl_error=None, advantages=adv, returns=ret)


def run_loss(ca, inp: dict, mode: str, agg: str, settings: dict, weights: bool, seed: int) -> dict:
    pl = {k: settings[k] for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef",
                                   "dro_beta")}
    config = ActorConfig(**{k: v for k, v in settings.items() if k not in pl}, policy_loss=_Config(**pl),
                         global_batch_info={"loss_scale_factor": settings["loss_scale_factor"]}
                         if settings["loss_scale_factor"] else {})
    log_prob = inp["log_prob"].clone().requires_grad_(True)
    torch.manual_seed(seed)
    loss, metrics = ca.get_policy_loss_fn(mode)(
        old_log_prob=inp["old_log_prob"], log_prob=log_prob, advantages=inp["advantages"],
        response_mask=inp["response_mask"], loss_agg_mode=agg, config=config,
        rollout_is_weights=inp["rollout_is_weights"] if weights else None)
    loss.backward()
    metrics = {sys.intern(k.removeprefix("actor/")): float(v) for k, v in metrics.items()}
    return dict(loss=float(loss.detach()), grad=log_prob.grad.clone(), metrics=metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verl_root", type=Path)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "tests" / "data" /
                        "verl_0_9_1" / "core_algos_cases.pt")
    a = parser.parse_args()
    torch.set_num_threads(1)
    ca = load_core_algos(a.verl_root)

    est_inputs, est_cases = estimator_inputs(), []
    for i, inp in enumerate(est_inputs):
        for name in ESTIMATORS:
            variants = [dict()]
            if name in ("grpo", "grpo_passk"):
                variants = [dict(norm_adv_by_std_in_grpo=True), dict(norm_adv_by_std_in_grpo=False)]
            elif name in ("gae", "reinforce_plus_plus"):
                variants = [dict(gamma=1.0, lam=1.0), dict(gamma=0.9, lam=0.95)]
            for algo in variants:
                for groups in ([GROUPS, PASSK_GROUPS] if name == "grpo_passk" else [GROUPS]):
                    est_cases.append(dict(input=i, name=name, algo=algo, groups=list(groups),
                                          **run_estimator(ca, inp, name, groups, **algo)))

    loss_in, loss_cases, seed = loss_inputs(), [], 0
    for i, inp in enumerate(loss_in):
        for s, settings in enumerate(LOSS_SETTINGS[:2]):
            for mode in LOSS_MODES:
                for agg in AGG_MODES:
                    for weights in (False, True):
                        seed += 1
                        loss_cases.append(dict(input=i, settings=s, mode=mode, agg=agg, weights=weights, seed=seed,
                                               **run_loss(ca, inp, mode, agg, settings, weights, seed)))

    for i, inp in enumerate(loss_in):
        for s, settings in enumerate(LOSS_SETTINGS[:2]):
            for mode in NEW_LOSS_MODES:
                for agg in AGG_MODES:
                    for weights in (False, True):
                        seed += 1
                        loss_cases.append(dict(input=i, settings=s, mode=mode, agg=agg, weights=weights, seed=seed,
                                               **run_loss(ca, inp, mode, agg, settings, weights, seed)))
    agg_inputs = list(loss_in)
    loss_in = loss_in + [tie_loss_input()]
    for agg in AGG_MODES:
        seed += 1
        loss_cases.append(dict(input=2, settings=2, mode="vanilla", agg=agg, weights=False, seed=seed,
                               **run_loss(ca, loss_in[2], "vanilla", agg, LOSS_SETTINGS[2], False, seed)))
    otb_in, new_est_cases = new_estimator_cases(ca, est_inputs)

    agg_cases = []
    for i, inp in enumerate(agg_inputs):
        loss_mat = inp["log_prob"] * inp["advantages"]
        for agg in AGG_MODES:
            for kw in (dict(), dict(batch_num_tokens=97, global_batch_size=17, loss_scale_factor=7)):
                value = ca.agg_loss(loss_mat, inp["response_mask"], agg, **kw)
                agg_cases.append(dict(input=i, agg=agg, kwargs=kw, loss=float(value)))

    version = (a.verl_root / "verl" / "version" / "version").read_text().strip()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    data = dict(verl_version=version, estimator_inputs=est_inputs, estimator_cases=est_cases + new_est_cases,
                otb_inputs=otb_in, loss_inputs=loss_in, loss_settings=LOSS_SETTINGS, loss_cases=loss_cases,
                agg_cases=agg_cases)
    if a.out.exists():
        _keep_recorded(torch.load(a.out, weights_only=False), data)
    torch.save(data, a.out)
    errors = sorted({c["verl_error"] for c in est_cases if c["verl_error"]})
    print(f"{len(data['estimator_cases'])} estimator, {len(loss_cases)} loss and {len(agg_cases)} agg_loss cases "
          f"from verl "
          f"{version} -> {a.out} ({a.out.stat().st_size} bytes); verl raised: {errors}")


def _keep_recorded(old: dict, new: dict) -> None:
    """Keep the stored file's cases bit for bit where this run recomputed them: float noise of another CPU (a
    vectorised sigmoid, 2e-9) must not rewrite them. Anything beyond 1e-6 is an error, not noise."""
    def same(got, value, where: str) -> None:
        if isinstance(value, dict):
            assert isinstance(got, dict) and set(got) == set(value), where
            for k in value:
                same(got[k], value[k], f"{where}.{k}")
        elif isinstance(value, (list, tuple)):
            assert len(got) == len(value), where
            for j, (x, y) in enumerate(zip(got, value)):
                same(x, y, f"{where}[{j}]")
        elif isinstance(value, torch.Tensor):
            torch.testing.assert_close(got, value, rtol=1e-6, atol=1e-6, equal_nan=True, msg=where)
        elif isinstance(value, float):
            assert abs(got - value) <= 1e-6 * max(1.0, abs(value)) or (got != got and value != value), where
        else:
            assert got == value, where

    for key in ("estimator_cases", "loss_cases", "agg_cases"):
        for i, was in enumerate(old[key]):
            same(new[key][i], was, f"{key}[{i}]")
            new[key][i] = was


if __name__ == "__main__":
    main()
