"""vLLM's engine inside a trainer rank (actor_rollout_ref.rollout.mode=sync): each model-parallel group's first rank
holds a `vllm.LLM` on its GPU beside the actor, asleep between rollouts.

- Weights by reference: the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so each exported
  bucket goes to the model's own `load_weights` (vLLM's checkpoint loader: q/k/v stacked into qkv_proj, gate/up into
  gate_up_proj, experts mapped) without a copy, a socket or a disk.
- Sleep and wake (`free_cache_engine`): after a step's rollout `release_weights` puts the engine to sleep (level 2:
  weights and KV cache freed, as the next sync reloads every weight; level 1, weights kept in host memory, for a
  LoRA actor whose syncs send only the adapted layers); a sync wakes the weights, loads, then wakes the KV cache.
- Per-sample seeds: one `vllm.SamplingParams` per row (`LLM.generate` takes a list), each with its sample's seed.
- Images: the row's decoded images as `multi_modal_data` beside its token ids (which hold the image tokens).
- LoRA (lora_sync=adapter): a `LoRARequest` per adapter version names every generation's adapter.
An `LLM.generate` call cannot be cut short from another thread with its tokens kept: partial rollouts need
mode=async (servers). Tensor parallelism across trainer ranks (vLLM's external launcher) is not wired: rollout
tensor_model_parallel_size is 1 here (the config refuses more).
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Optional, Sequence

from megappo.rollout.base import Bucket, RolloutEngine
from megappo.rollout.sampling import Completion, SamplingParams
from megappo.rollout.seeds import request_seeds
from megappo.rollout.vllm.requests import LOGPROBS_MODE, lora_serving, parse_output, sampling_fields


def engine_args(settings: Any, dtype: str, *, routes: bool) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments from the rollout settings (verl's knob names map one to one), then the user's
    `engine_kwargs` (vLLM's own EngineArgs names), which win."""
    kw: dict[str, Any] = {
        "model": settings.model_path, "dtype": dtype, "seed": int(settings.seed),
        "trust_remote_code": bool(settings.trust_remote_code),
        "tensor_parallel_size": int(settings.tensor_model_parallel_size),
        "gpu_memory_utilization": float(settings.gpu_memory_utilization),
        "max_num_seqs": int(settings.max_num_seqs), "enforce_eager": bool(settings.enforce_eager),
        "enable_sleep_mode": bool(settings.free_cache_engine), "logprobs_mode": LOGPROBS_MODE,
        "enable_prefix_caching": True,
    }
    if settings.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = int(settings.max_num_batched_tokens)
    if settings.max_model_len:
        kw["max_model_len"] = int(settings.max_model_len)
    if routes:
        kw["enable_return_routed_experts"] = True
    kw.update(lora_serving(settings.lora_adapter))
    kw.update(settings.engine_kwargs)
    return kw


class VLLMColocatedEngine(RolloutEngine):
    """A `vllm.LLM` in this process. settings: `RolloutSettings`; routes: the model's `RouteLayout` (router replay
    R3) or None."""

    def __init__(self, settings: Any, dtype: str, *, routes: Any = None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model in this process: weights by reference
        from vllm import LLM

        # level 1: the weights wait in host memory (a partial sync, a LoRA actor's adapted layers, keeps the others)
        self.routes, self.sleep_level = routes, 1
        self.llm = LLM(**engine_args(settings, dtype, routes=routes is not None))
        self.free_cache = bool(settings.free_cache_engine)
        self.asleep: Optional[int] = None  # the sleep level, None awake
        self.lora: Any = None  # the served adapter's LoRARequest

    def _wake(self, tags: Optional[list[str]] = None) -> None:
        if self.asleep is not None:
            self.llm.wake_up(tags=tags)
            if tags is None or "kv_cache" in tags:
                self.asleep = None

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, prompt_offset: int = 0,
                 multi_modal: Optional[Sequence[Any]] = None) -> list[list[Completion]]:
        from vllm import SamplingParams as VLLMSamplingParams

        if self.asleep == 2:
            raise RuntimeError("the vLLM engine's weights were released (release_weights); load weights first")
        self._wake()
        rows = [i for i in range(len(prompts)) for _ in range(params.n)]
        seeds = request_seeds(params, len(prompts), prompt_offset)
        inputs = []
        for i in rows:
            item: dict[str, Any] = {"prompt_token_ids": [int(t) for t in prompts[i]]}
            images = multi_modal[i].images if multi_modal is not None and multi_modal[i] is not None else None
            if images:
                item["multi_modal_data"] = {"image": list(images)}
            inputs.append(item)
        sampling = [VLLMSamplingParams(**sampling_fields(params, seed)) for seed in seeds]
        outputs = self.llm.generate(inputs, sampling, use_tqdm=False, lora_request=self.lora)
        grouped: list[list[Completion]] = [[] for _ in prompts]
        routes = self.routes if params.return_routed_experts else None
        for i, out in zip(rows, outputs):
            grouped[i].append(parse_output(out.outputs[0], i, weight_version=self.weight_version, partial=False,
                                           routes=routes))
        return grouped

    def release_weights(self) -> bool:
        """Sleep until the next sync: level 2 (weights and KV cache freed) or 1 (a LoRA actor's partial syncs need
        the base weights kept, in host memory)."""
        if not self.free_cache or self.asleep is not None:
            return False
        self.llm.sleep(level=self.sleep_level)
        self.asleep = self.sleep_level
        return True

    def load_weights(self, buckets: Iterable[Bucket], *, version: int, mode: str = "tensor",
                     partial: bool = False) -> int:
        if mode != "tensor":
            raise ValueError(f"the colocated vLLM engine takes the weights in process (tensor), not {mode!r}")
        if partial and self.asleep == 2:
            raise RuntimeError("a partial weight sync after a level-2 sleep would leave the other weights unset")
        self._wake(["weights"])
        for bucket in buckets:
            self.llm.apply_model(lambda model, b=bucket: model.load_weights(iter(b)))
        self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values
        self._wake(["kv_cache"])
        self.weight_version = int(version)
        return self.weight_version

    def update_weights_from_disk(self, model_path: str, *, version: int) -> int:
        self._wake(["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_path)})
        self.llm.reset_prefix_cache()
        self._wake(["kv_cache"])
        self.weight_version = int(version)
        return self.weight_version

    def load_lora_adapter(self, adapter_dir: str, *, version: int) -> int:
        from vllm.lora.request import LoRARequest

        self.lora = LoRARequest(f"megappo-v{int(version)}", int(version) + 1, str(adapter_dir))
        self.weight_version = int(version)
        return self.weight_version

    def prompt_log_probs(self, token_ids: Sequence[int]) -> list[list[float]]:
        return [self.sequence_log_probs([token_ids])[0]]

    def sequence_log_probs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        from vllm import SamplingParams as VLLMSamplingParams

        self._wake()
        params = VLLMSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outputs = self.llm.generate([{"prompt_token_ids": [int(t) for t in s]} for s in sequences], params,
                                    use_tqdm=False, lora_request=self.lora)
        return [[float(pos[int(t)].logprob) for pos, t in zip(out.prompt_logprobs[1:], seq[1:])]
                for out, seq in zip(outputs, sequences)]

    def close(self) -> None:
        super().close()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            del llm
