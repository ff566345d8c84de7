"""Record verl 0.9.1's rollout-correction outputs on seeded random inputs, for megappo's agreement test.

    python tools/verl_reference/rollout_corr_cases.py PATH_TO_VERL [--out tests/data/verl_0_9_1/rollout_corr_cases.pt]

PATH_TO_VERL is a directory holding the ``verl`` package of release 0.9.1: a checkout of the v0.9.1 tag, or the
unpacked wheel (``pip download verl==0.9.1 --no-deps`` and unzip it; that is what the stored file was made from).

verl's ``verl/trainer/ppo/rollout_corr_helper.py`` is run as is. Importing ``verl`` normally pulls in Ray,
tensordict and the whole config tree, so the two files that carry the math are loaded with importlib instead:
``verl/utils/torch_functional.py`` (masked_sum / masked_mean / distributed_masked_mean) and the helper itself.
Before that, stand-ins are put into ``sys.modules`` for imports that carry no numbers: ``tensordict.TensorDict`` and
``transformers.PreTrainedTokenizer`` (type annotations in torch_functional), ``verl.utils.device`` (used only by
functions not called here), ``verl.protocol.DataProto`` (the helper wraps the weights in one; the stand-in keeps the
dict) and the config classes ``RolloutCorrectionConfig`` / ``PolicyLossConfig`` (annotations). Nothing the
computed numbers depend on is replaced.

Cases: three input sets (float32 with padding and an empty row; float64 with a bool mask; float32 with log-ratios
far beyond verl's +-20 clamp) x every IS setting (off; token / sequence; TIS / IcePop threshold; batch
normalisation on / off) x rejection off, plus every rejection option alone and two multi-option specs with IS off,
plus every rejection setting with token TIS. Batch normalisation is also recorded with torch.distributed up
(one gloo rank), where verl takes its distributed_masked_mean path. Where verl raises (ZeroDivisionError in its
effective sample size when IcePop zeroes every weight) the case records the error instead of outputs.

Added after those (the cases above stay as they were): ``presets``, the fields of each of verl's named
``RolloutCorrectionConfig`` presets (``verl/trainer/config/algorithm.py`` and ``verl/base_config.py``, verl's own
files, each classmethod that returns a config, called with its defaults); ``bypass_cases``, verl's
``compute_policy_loss_bypass_mode`` (``core_algos.py``, loaded as ``core_algos_cases.py`` does) for both loss types
x token-mean / seq-mean-token-sum / seq-mean-token-sum-norm with and without a loss_scale_factor x three
corrections, on the first input set with random advantages and on the four-token example of B=1, T=4, equal
log-probs, A=1 (loss, gradient with respect to log_prob, ppo_kl); ``preset_cases``, each preset run as verl runs it
(a bypass preset's loss on a third bypass input, close to the rollout policy but for every third row; a decoupled
one's weights, mask and metrics on a fourth, the first input set with that same old policy).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types
from pathlib import Path

import torch

B, R = 8, 12
IS_SETTINGS = [dict(rollout_is=None)] + [
    dict(rollout_is=level, rollout_is_threshold=thr, rollout_is_batch_normalize=bn)
    for level in ("token", "sequence") for thr in (2.0, "0.5_5.0") for bn in (False, True)
]
RS_SETTINGS = [
    ("token_k1", "0.8_1.25"), ("token_k2", 0.03), ("token_k3", "0.03"),
    ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k2", 0.4), ("seq_sum_k3", 0.4),
    ("seq_mean_k1", 1.05), ("seq_mean_k2", 0.04), ("seq_mean_k3", 0.04),
    ("seq_max_k2", 0.3), ("seq_max_k3", 0.3),
    ("token_k1,seq_mean_k3", "0.8_1.25,0.04"), ("seq_sum_k2, seq_max_k3,seq_sum_k2", "0.5"),
]


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_verl_helper(verl_root: Path) -> types.ModuleType:
    pkg = verl_root / "verl"
    version = (pkg / "version" / "version").read_text().strip()
    if version != "0.9.1":
        print(f"warning: {pkg} is verl {version}, not 0.9.1", file=sys.stderr)

    class DataProto:  # the helper only wraps its weights: DataProto.from_dict(tensors={...}).batch[...]
        def __init__(self, batch):
            self.batch = batch

        @classmethod
        def from_dict(cls, tensors):
            return cls(dict(tensors))

    class _Annotation:
        pass

    _module("tensordict", TensorDict=_Annotation)
    _module("transformers", PreTrainedTokenizer=_Annotation)
    for name in ("verl", "verl.utils", "verl.trainer", "verl.trainer.ppo", "verl.trainer.config", "verl.workers",
                 "verl.workers.config"):
        _module(name).__path__ = []
    _module("verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: torch.cpu)
    _module("verl.protocol", DataProto=DataProto)
    _module("verl.trainer.config.algorithm", RolloutCorrectionConfig=_Annotation)
    _module("verl.workers.config.actor", PolicyLossConfig=_Annotation)
    sys.modules["verl.utils"].torch_functional = _load("verl.utils.torch_functional",
                                                       pkg / "utils" / "torch_functional.py")
    return _load("verl.trainer.ppo.rollout_corr_helper", pkg / "trainer" / "ppo" / "rollout_corr_helper.py")


def make_inputs() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(20250901)
    out = []
    for dtype, mask_dtype, scale, outliers in ((torch.float32, torch.int64, 0.3, 2.0),
                                               (torch.float64, torch.bool, 0.3, 2.0),
                                               (torch.float32, torch.int64, 3.0, 40.0)):
        old = -3.0 * torch.rand(B, R, generator=g, dtype=torch.float64)
        log_ratio = scale * torch.randn(B, R, generator=g, dtype=torch.float64)
        spikes = torch.rand(B, R, generator=g) < 0.05
        log_ratio = torch.where(spikes, outliers * torch.sign(torch.randn(B, R, generator=g)), log_ratio)
        lengths = torch.randint(1, R + 1, (B,), generator=g)
        if mask_dtype is torch.int64:
            lengths[3] = 0  # a zero-length response
        lengths[0] = R
        mask = torch.arange(R)[None, :] < lengths[:, None]
        rollout = old - log_ratio
        # finite garbage on padding: verl multiplies padding by 0 / skips it, so it must not matter
        old = torch.where(mask, old, torch.full_like(old, -7.5))
        rollout = torch.where(mask, rollout, torch.full_like(rollout, 0.25))
        out.append(dict(old_log_probs=old.to(dtype), rollout_log_probs=rollout.to(dtype),
                        response_mask=mask.to(mask_dtype)))
    return out


def run_case(helper, inputs: dict[str, torch.Tensor], settings: dict) -> dict:
    args = dict(rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False, rollout_rs=None,
                rollout_rs_threshold=None)
    args.update(settings)
    try:
        proto, mask, metrics = helper.compute_rollout_correction_and_rejection_mask(
            old_log_prob=inputs["old_log_probs"], rollout_log_prob=inputs["rollout_log_probs"],
            response_mask=inputs["response_mask"], **args)
    except ZeroDivisionError as e:  # verl's effective sample size when IcePop zeroes every weight
        return dict(verl_error=f"ZeroDivisionError: {e}", weights=None, mask=None, metrics=None)
    weights = None if proto is None else proto.batch["rollout_is_weights"]
    metrics = {sys.intern(k): float(v) for k, v in metrics.items()}  # interned: each key stored once
    return dict(verl_error=None, weights=weights, mask=mask, metrics=metrics)


BYPASS_CORRECTIONS = [dict(), dict(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4"),
                      dict(rollout_is="sequence", rollout_is_threshold="0.5_5.0")]
BYPASS_AGGS = [("token-mean", None), ("seq-mean-token-sum", None), ("seq-mean-token-sum-norm", None),
               ("seq-mean-token-sum-norm", 7)]


def verl_presets(verl_root: Path) -> dict[str, dict]:
    """{preset name: its fields}, from verl's RolloutCorrectionConfig classmethods called with their defaults."""
    import dataclasses
    import inspect

    pkg = verl_root / "verl"
    _load("verl.base_config", pkg / "base_config.py")
    cls = _load("verl_algorithm_config", pkg / "trainer" / "config" / "algorithm.py").RolloutCorrectionConfig
    out = {}
    for name, member in cls.__dict__.items():
        if isinstance(member, classmethod) and inspect.signature(member.__func__).return_annotation in (
                "RolloutCorrectionConfig", cls):
            out[name] = {k: v for k, v in dataclasses.asdict(getattr(cls, name)()).items() if not k.startswith("_")}
    return out


def _bypass_loss(ca, inp: dict, corr: dict, agg: str, factor) -> dict:
    """verl's compute_policy_loss_bypass_mode on `inp`: loss, gradient with respect to log_prob, ppo_kl."""
    from core_algos_cases import ActorConfig, _Config

    config = ActorConfig(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                         policy_loss=_Config(rollout_correction=_Config(**corr)),
                         global_batch_info={"loss_scale_factor": factor} if factor else {})
    log_prob = inp["log_prob"].clone().requires_grad_(True)
    loss, metrics = ca.get_policy_loss_fn("bypass_mode")(
        old_log_prob=inp["rollout_log_prob"], log_prob=log_prob, advantages=inp["advantages"],
        response_mask=inp["response_mask"], loss_agg_mode=agg, config=config)
    loss.backward()
    return dict(loss=float(loss.detach()), grad=log_prob.grad.clone(), ppo_kl=float(metrics["actor/ppo_kl"]))


def bypass_cases(verl_root: Path, inputs: list[dict], presets: dict[str, dict]
                 ) -> tuple[list[dict], list[dict], list[dict]]:
    """verl's bypass-mode loss: (inputs, cases, one case per preset: a bypass preset's loss on the third input,
    a decoupled one's weights, mask and metrics on the fourth)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from core_algos_cases import load_core_algos

    ca = load_core_algos(verl_root)  # its bypass loss imports the helper loaded above, from sys.modules
    g = torch.Generator().manual_seed(31)
    first = inputs[0]
    b_inputs = [dict(log_prob=first["old_log_probs"].clone(), rollout_log_prob=first["rollout_log_probs"],
                     advantages=torch.randn(B, R, generator=g), response_mask=first["response_mask"]),
                dict(log_prob=torch.full((1, 4), -1.0), rollout_log_prob=torch.full((1, 4), -1.0),
                     advantages=torch.ones(1, 4), response_mask=torch.ones(1, 4, dtype=torch.int64))]
    cases = []
    for i, inp in enumerate(b_inputs):
        for loss_type in ("ppo_clip", "reinforce"):
            for corr in BYPASS_CORRECTIONS:
                for agg, factor in BYPASS_AGGS:
                    cases.append(dict(input=i, loss_type=loss_type, correction=corr, agg=agg,
                                      loss_scale_factor=factor,
                                      **_bypass_loss(ca, inp, dict(loss_type=loss_type, **corr), agg, factor)))
    # near the rollout policy (geometric-mean ratios within the presets' 0.1 %), but for the rows that drifted
    g = torch.Generator().manual_seed(32)
    drift = torch.where(torch.arange(B)[:, None] % 3 == 0, torch.full((B, 1), 0.2), torch.full((B, 1), 3e-4))
    near = dict(b_inputs[0])
    near["log_prob"] = near["rollout_log_prob"] + drift * torch.randn(B, R, generator=g)
    b_inputs.append(near)
    decoupled = dict(inputs[0], old_log_probs=near["log_prob"])  # the same closeness for old vs rollout
    preset_cases = []
    for name, fields in presets.items():
        if fields["bypass_mode"]:
            preset_cases.append(dict(name=name, **_bypass_loss(ca, near, fields, "token-mean", None)))
        else:
            settings = {k: v for k, v in fields.items() if k not in ("bypass_mode", "loss_type")}
            preset_cases.append(dict(name=name, **run_case(_helper(), decoupled, settings)))
    return b_inputs + [decoupled], cases, preset_cases


def _helper() -> types.ModuleType:
    return sys.modules["verl.trainer.ppo.rollout_corr_helper"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verl_root", type=Path)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "tests" / "data" /
                        "verl_0_9_1" / "rollout_corr_cases.pt")
    a = parser.parse_args()
    torch.set_num_threads(1)
    helper = load_verl_helper(a.verl_root)
    inputs = make_inputs()

    settings = [dict(s) for s in IS_SETTINGS]
    settings += [dict(rollout_rs=rs, rollout_rs_threshold=t) for rs, t in RS_SETTINGS]
    settings += [dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs=rs, rollout_rs_threshold=t)
                 for rs, t in RS_SETTINGS]
    cases = []
    for i, inp in enumerate(inputs):
        for s in settings:
            cases.append(dict(input=i, settings=s, distributed=False, **run_case(helper, inp, s)))

    # batch normalisation under torch.distributed (verl's distributed_masked_mean path), one gloo rank
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        for i, inp in enumerate(inputs):
            for s in IS_SETTINGS:
                if s.get("rollout_is_batch_normalize"):
                    cases.append(dict(input=i, settings=dict(s), distributed=True, **run_case(helper, inp, s)))
    finally:
        torch.distributed.destroy_process_group()

    presets = verl_presets(a.verl_root)
    b_inputs, b_cases, preset_cases = bypass_cases(a.verl_root, inputs, presets)

    version = (a.verl_root / "verl" / "version" / "version").read_text().strip()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dict(verl_version=version, inputs=inputs, cases=cases, presets=presets, bypass_inputs=b_inputs,
                    bypass_cases=b_cases, preset_cases=preset_cases), a.out)
    masked = [(c["metrics"] or {}).get("rollout_corr/rollout_rs_masked_fraction") for c in cases]
    masked = [round(x, 3) for x in masked if x is not None]
    print(f"{len(cases)} cases from verl {version} -> {a.out} ({a.out.stat().st_size} bytes); "
          f"rollout_rs_masked_fraction seen: {sorted(set(masked))}; {len(presets)} presets, "
          f"{len(b_cases)} bypass-loss cases")


if __name__ == "__main__":
    main()
