"""vLLM's engine inside a trainer rank (actor_rollout_ref.rollout.mode=sync): each model-parallel group's first rank
holds a `vllm.LLM` on its GPU beside the actor, asleep between rollouts.

- Weights by reference: the engine core and its worker run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 and
  one worker: vLLM's UniProcExecutor), so the exported buckets reach the worker's `reload_weights` as the very tensor
  objects, without a pickle, a socket or a disk; the model's checkpoint loader (q/k/v into qkv_proj, gate/up into
  gate_up_proj) copies each into the model's own storage. `reload_weights`, not `model.load_weights`: vLLM processes
  weights after loading (on CPU it repacks linear weights and empties the originals, so a second `load_weights`
  fails), and `reload_weights` restores the checkpoint layout, loads and processes again, layer by layer. A layer
  is processed once all its tensors arrived, so all buckets stream through one call (a bucket boundary may split
  q/k/v); a layer none of whose tensors arrive keeps its weights (partial syncs), and a sync that sends only part
  of a fused layer (q_proj alone) is refused (`split_layers`).
- Sleep and wake (`free_cache_engine`): after a step's rollout `release_weights` puts the engine to sleep (level 2:
  weights and KV cache freed, as the next sync reloads every weight; level 1, weights kept in host memory, for a
  LoRA actor whose syncs send only the adapted layers); a sync wakes the weights, loads, then wakes the KV cache.
  vLLM's sleep mode exists only where `current_platform.is_sleep_mode_available()` (CUDA, ROCm, XPU): elsewhere
  (CPU) the engine is built without it and `release_weights` frees nothing.
- Per-sample seeds: one `vllm.SamplingParams` per row (`LLM.generate` takes a list), each with its sample's seed.
- Images: the row's decoded images as `multi_modal_data` beside its token ids, each image's tokens collapsed to one
  placeholder that vLLM's processor expands again (its answer's prompt must come back as long as megappo's).
- LoRA (lora_sync=adapter): a `LoRARequest` per adapter version names every generation's adapter.
An `LLM.generate` call cannot be cut short from another thread with its tokens kept: partial rollouts need
mode=async (servers). Tensor parallelism across trainer ranks (vLLM's external launcher) is not wired: rollout
tensor_model_parallel_size is 1 here (the config refuses more).
"""
from __future__ import annotations

import itertools
import os
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

from megappo.rollout.base import Bucket, RolloutEngine
from megappo.rollout.sampling import Completion, SamplingParams, check_prompts, check_scored
from megappo.rollout.seeds import request_seeds
from megappo.rollout.vllm.requests import LOGPROBS_MODE, lora_serving, model_eos_ids, parse_output, sampling_fields


def engine_args(settings: Any, dtype: str, *, routes: bool, sleep_mode: bool) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments (vLLM's `EngineArgs` names) from the rollout settings (verl's knob names map one
    to one), then the user's `engine_kwargs`, which win. sleep_mode: free_cache_engine where the platform has vLLM's
    sleep mode (`sleep_mode_available`); asking for it elsewhere is vLLM's ValueError at start."""
    kw: dict[str, Any] = {
        "model": settings.model_path, "dtype": dtype, "seed": int(settings.seed),
        "trust_remote_code": bool(settings.trust_remote_code),
        "tensor_parallel_size": int(settings.tensor_model_parallel_size),
        "gpu_memory_utilization": float(settings.gpu_memory_utilization),
        "max_num_seqs": int(settings.max_num_seqs), "enforce_eager": bool(settings.enforce_eager),
        "enable_sleep_mode": bool(sleep_mode), "logprobs_mode": LOGPROBS_MODE,
        "enable_prefix_caching": True, "generation_config": "vllm",  # every sampling field is megappo's, as sent
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


def sleep_mode_available() -> bool:
    """Whether vLLM's sleep mode (`LLM.sleep` / `wake_up`, CUDA's memory pool) exists on this platform."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def repack_tied_linears(model: Any) -> int:
    """Re-derive the CPU platform's packed copy (`cpu_linear`) of each layer whose weight is another layer's (a tied
    lm_head): `reload_weights` loads and repacks the layer that owns the tensor, but the tied one receives no tensor
    of its own, so it would go on computing with the old weights' packed copy. Returns how many were repacked
    (0 off CPU: GPU layers read their weight tensor, which the owner's reload updated in place)."""
    sharers: dict[int, list[Any]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            sharers.setdefault(id(param), []).append(module)
    repacked = 0
    for modules in sharers.values():
        for module in modules if len(modules) > 1 else ():
            if hasattr(module, "cpu_linear"):
                module.quant_method.process_weights_after_loading(module)
                repacked += 1
    return repacked


def split_layers(names: Iterable[str], fused_parts: Mapping[str, Sequence[str]]) -> list[str]:
    """The fused vLLM parameters (`fused_parts`: the model's packed_modules_mapping, e.g. qkv_proj <- q/k/v_proj) of
    which the HF tensor `names` hold some parts but not all."""
    fused_of = {part: fused for fused, parts in fused_parts.items() for part in parts}
    seen: dict[str, set[str]] = {}
    for name in names:
        module, _, param = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf in fused_of:
            seen.setdefault(f"{parent}.{fused_of[leaf]}.{param}", set()).add(leaf)
    return sorted(k for k, got in seen.items() if len(got) < len(fused_parts[k.rsplit(".", 2)[-2]]))


class VLLMColocatedEngine(RolloutEngine):
    """A `vllm.LLM` in this process. settings: `RolloutSettings`; routes: the model's `RouteLayout` (router replay
    R3) or None."""

    def __init__(self, settings: Any, dtype: str, *, routes: Any = None):
        # the engine core and worker in this process, whatever the environment says: load_weights hands the worker
        # a generator of the trainer's tensors, which no other process could take
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if routes is not None:  # vLLM 0.32 records routed experts in its Model Runner V2 only (needs Triton)
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        from vllm import LLM

        # level 2 frees the weights (every sync reloads them all); a LoRA actor's syncs send only the adapted layers,
        # so its base waits in host memory (level 1)
        self.routes, self.sleep_level = routes, (1 if settings.lora_adapter is not None else 2)
        self.sleep_mode = bool(settings.free_cache_engine) and sleep_mode_available()
        self.llm = LLM(**engine_args(settings, dtype, routes=routes is not None,
                                     sleep_mode=self.sleep_mode))
        self.eos_ids = model_eos_ids(settings.model_path)  # stop tokens: generation_config.json is not vLLM's here
        self.asleep: Optional[int] = None  # the sleep level, None awake
        self.lora: Any = None  # the served adapter's LoRARequest
        self.loaded_tensors = 0  # tensors the last load_weights streamed into the model
        self.fused_parts: dict[str, list[str]] = self.llm.apply_model(
            lambda model: {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()})[0]
        # a vision-language model's <|image_pad|> id (see _input); None for a text model
        self.image_token_id = getattr(self.llm.llm_engine.model_config.hf_config, "image_token_id", None)
        self._label(self.weight_version)

    def _label(self, version: int) -> None:
        """Name the engine's weights `version`: vLLM tags each output token with it (`weight_versions` spans)."""
        self.weight_version = int(version)
        self.llm.llm_engine.set_weight_version(str(self.weight_version))

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
        inputs = [self._input(prompts, multi_modal, i) for i in rows]
        sampling = [VLLMSamplingParams(**sampling_fields(params, seed, self.eos_ids)) for seed in seeds]
        outputs = self.llm.generate(inputs, sampling, use_tqdm=False, lora_request=self.lora)
        grouped: list[list[Completion]] = [[] for _ in prompts]
        routes = self.routes if params.return_routed_experts else None
        for i, out in zip(rows, outputs):
            if len(out.prompt_token_ids) != len(prompts[i]):
                # vLLM expanded the collapsed image tokens from its own processing of the image: another count
                # than the data loader's means the two sized the image differently
                raise RuntimeError(f"vLLM ran prompt {i} as {len(out.prompt_token_ids)} tokens, not its "
                                   f"{len(prompts[i])}: its image processor sized the images unlike megappo's")
            grouped[i].append(parse_output(out.outputs[0], i, weight_version=self.weight_version, partial=False,
                                           routes=routes))
        return grouped

    def _input(self, prompts: Sequence[Sequence[int]], multi_modal: Optional[Sequence[Any]], i: int
               ) -> dict[str, Any]:
        """Prompt i as `LLM.generate` takes it: token ids, and a prompt with images has each image's run of image
        tokens collapsed to one, which vLLM's processor expands again from the image (vLLM 0.32 expands every
        placeholder of a token prompt, whether or not it already is)."""
        check_prompts([prompts[i]])
        m = multi_modal[i] if multi_modal is not None else None
        if m is None:
            return {"prompt_token_ids": [int(t) for t in prompts[i]]}
        from megappo.data.multimodal import collapse_image_runs

        ids = collapse_image_runs([prompts[i]], [m], self.image_token_id, "vLLM")[0]
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": list(m.images)}}

    def release_weights(self) -> bool:
        """Sleep until the next sync: level 2 (weights and KV cache freed) or 1 (a LoRA actor's partial syncs need
        the base weights kept, in host memory). False, freeing nothing, without sleep mode (free_cache_engine off,
        or a platform without it: CPU)."""
        if not self.sleep_mode or self.asleep is not None:
            return False
        self.llm.sleep(level=self.sleep_level)
        self.asleep = self.sleep_level
        return True

    def load_weights(self, buckets: Iterable[Bucket], *, version: int, mode: str = "tensor",
                     partial: bool = False) -> int:
        """Every bucket's HF-named tensors into the model in one `reload_weights` pass (see the module docstring);
        partial: only some layers' tensors, whole layers (a LoRA actor's adapted ones), the others kept."""
        if mode != "tensor":
            raise ValueError(f"the colocated vLLM engine takes the weights in process (tensor), not {mode!r}")
        if partial and self.asleep == 2:
            raise RuntimeError("a partial weight sync after a level-2 sleep would leave the other weights unset")
        self.loaded_tensors, names = 0, []

        def tensors() -> Iterator[tuple[str, Any]]:
            for bucket in buckets:
                for name, tensor in bucket:
                    self.loaded_tensors += 1
                    names.append(name)
                    yield name, tensor

        stream = tensors()
        first = next(stream, None)
        if first is None:  # before waking or touching the model: an empty sync changes nothing
            raise ValueError("load_weights got no tensors")
        self._wake(["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": itertools.chain([first], stream)})
        split = split_layers(names, self.fused_parts)
        if split:  # known only once streamed: vLLM processed those layers with their missing parts uninitialised
            raise RuntimeError(f"the sync sent only some of the tensors vLLM fuses into {split[:4]} "
                               f"({len(split)} in all), whose other parts are now undefined: send whole layers")
        self._after_load(version)
        return self.weight_version

    def _after_load(self, version: int) -> None:
        self.llm.apply_model(repack_tied_linears)
        self._wake(["kv_cache"])
        self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values
        self._label(version)

    def update_weights_from_disk(self, model_path: str, *, version: int) -> int:
        self._wake(["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_path)})
        self._after_load(version)
        return self.weight_version

    def load_lora_adapter(self, adapter_dir: str, *, version: int) -> int:
        from vllm.lora.request import LoRARequest

        # a new id per version: vLLM caches adapters by id, so a reused id would serve the old adapter
        self.lora = LoRARequest(f"megappo-v{int(version)}", int(version) + 1, str(adapter_dir))
        self._label(version)
        return self.weight_version

    def prompt_log_probs(self, token_ids: Sequence[int]) -> list[list[float]]:
        return [self.sequence_log_probs([token_ids])[0]]

    def sequence_log_probs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        from vllm import SamplingParams as VLLMSamplingParams

        check_scored(sequences)
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
            llm.llm_engine.engine_core.shutdown()
            del llm
