"""The rollout engine's config rules (`actor_rollout_ref.rollout.name`, `mode`, `weight_sync` and what each engine
lacks), asked of the engine registry; reads the tree alone (no torch). `megappo.checks` runs them with the rest."""
from __future__ import annotations

from typing import Any

from megappo.rollout.registry import deployment_mode, routed_experts, sync_modes, unknown_engine

P = "actor_rollout_ref.rollout"
# measured: `--enable-return-routed-experts` needs VLLM_USE_V2_MODEL_RUNNER=1, whose model runner needs Triton, which
# has no CPU backend on PyPI (vLLM: "AuxOutput Connector requires Model Runner V2", then "Model Runner V2 requires
# Triton")
VLLM_CPU_ROUTES = ("vLLM 0.32 returns routed experts only from its Model Runner V2, which needs Triton (a GPU; x86 "
                   "CPUs would need triton-cpu, which is not on PyPI)")


def served(r: Any) -> bool:
    """Whether rollout `r`'s engine runs as servers (rollout.mode async), so server keys apply."""
    if unknown_engine(r.name):
        return r.name == "sglang"
    try:
        return deployment_mode(r.name, r.mode) == "async"
    except ValueError:
        return False


def engine_errors(cfg: Any, check_files: bool = False) -> list[str]:
    """The engine is registered, deployed in a mode it has, takes the weights by rollout.weight_sync, and can do
    what the rest of the config asks of it."""
    r, errors = cfg.actor_rollout_ref.rollout, []
    if r.server_urls and not served(r):
        errors.append(f"{P}.server_urls: names running servers but {P}.name={r.name} runs in the trainer's ranks (no "
                      f"servers); set {P}.name=sglang or vllm (mode async), or drop the URLs")
    if r.name != "sglang" and r.router != "none":
        errors.append(f"{P}.router: is {r.router} but {P}.name={r.name} (a router fronts SGLang servers); set "
                      f"{P}.name=sglang, or {P}.router=none")
    if reason := unknown_engine(r.name):
        return errors + [reason]
    try:
        mode = deployment_mode(r.name, r.mode)
    except ValueError as e:
        return errors + [f"{e}; set {P}.mode to one of those, or leave it null"]
    modes = sync_modes(r.name, r.mode)
    if r.weight_sync != "auto" and r.weight_sync not in modes:
        errors.append(f"{P}.weight_sync: is {r.weight_sync} but the {r.name} engine ({P}.mode={mode}) takes the "
                      f"weights by {', '.join(modes)}; use {P}.weight_sync=auto (= {modes[0]})"
                      + ("" if "disk" in modes else f", or {P}.name=sglang"))
    if r.enable_rollout_routing_replay and not routed_experts(r.name):
        errors.append(f"{P}.enable_rollout_routing_replay=true: the {r.name} engine cannot return routed experts; "
                      "set it to false and use mode R2 or disabled")
    return errors + (_vllm_errors(cfg, mode) if r.name == "vllm" else [])


def _vllm_errors(cfg: Any, mode: str) -> list[str]:
    r, errors = cfg.actor_rollout_ref.rollout, []
    rc = cfg.algorithm.rollout_correction
    if (r.top_k > 0 or r.top_p < 1.0) and (rc.bypass_mode or rc.rollout_is or rc.rollout_rs):
        from megappo.rollout.vllm.requests import FILTERED_LOGPROBS

        errors.append(f"{P}.name=vllm with top_k={r.top_k}, top_p={r.top_p} and algorithm.rollout_correction, which "
                      f"takes the engine's log-probs as the behaviour policy's: {FILTERED_LOGPROBS}; sample "
                      f"without the filter (top_k=-1, top_p=1), or use rollout.name=sglang or hf")
    if r.enable_rollout_routing_replay and cfg.trainer.device == "cpu":
        errors.append(f"{P}.enable_rollout_routing_replay with vllm on CPU: {VLLM_CPU_ROUTES}; use router replay R2 "
                      f"(the trainer's own routes), or {P}.name=hf or sglang on CPU")
    if mode == "sync":
        if r.tensor_model_parallel_size != 1:
            errors.append(f"{P}.mode=sync (vLLM in the trainer's ranks) runs one engine per model-parallel group's "
                          f"first rank, tensor_model_parallel_size 1; got {r.tensor_model_parallel_size}: use "
                          f"{P}.mode=async (vLLM servers at that size) or set it to 1")
        if cfg.async_training.partial_rollout and cfg.async_training.mode == "fully_async":
            errors.append(f"async_training.partial_rollout: vLLM's engine in the trainer's ranks cannot cut a "
                          f"generation short and keep its tokens; use {P}.mode=async (servers), or set "
                          "async_training.partial_rollout=false")
    return errors
