"""megappo's in-process rollout engine: a `transformers` model with a KV-cached sampling loop.

It is the default rollout on CPU (where SGLang's kernels do not run) and reads the same Hugging Face weights an
SGLang server would: it starts from a HF directory (the conversion code's output) and takes every later actor update
as checkpoint-named tensors (`update_weights(iter_hf_weights(...))`), so conversion and weight sync run wherever it
does. Requests and completions mirror SGLang's (`SamplingParams`, `Completion`).

Batches are left-padded; positions are counted from each row's first real token, and each sampled row draws from its
own generator, seeded with the sample's seed (`megappo.rollout.seeds`: the request's seed, the prompt's index in the
step's batch and the sample's index), so a row's tokens and log-probs do not depend on what it was batched with, nor
on how the batch was split over requests (up to float summation order). The decoding loop is `decode.py`'s: a row
leaves the forward batch when it stops, over a KV cache that grows in place, so a batch whose responses end at very
different lengths costs what its tokens cost. Every model forward of generation goes through `HFEngine._forward`.

A Qwen2-VL / Qwen2.5-VL directory loads as its `...ForConditionalGeneration` class; what its prompts' images
(`multi_modal`, one `MultiModalInputs` or None per prompt, the prompts' ids already holding the image tokens) add to
a forward batch is the model's prompt inputs' (`vlm.prompt_inputs`, chosen once).
"""
from __future__ import annotations

import inspect
import os
import threading
from typing import Iterable, Optional, Sequence, Union

import torch

from megappo.data.multimodal import MultiModalInputs
from megappo.rollout.base import RolloutEngine
from megappo.rollout.hf.decode import KVCache, Prefill, RowSampler, decode, num_cached_layers
from megappo.rollout.hf.routing import RouteRecorder
from megappo.rollout.hf.vlm import MultiModal, prompt_inputs
from megappo.rollout.hf.weights import HFWeightLoader
from megappo.rollout.sampling import Completion, SamplingParams, check_prompts
from megappo.rollout.seeds import request_seeds

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def _load_model(model_path: str, trust_remote_code: bool, dtype_kw: dict):
    """The HF model of `model_path`, by its kind's transformers auto class (`megappo.kinds`)."""
    import transformers

    from megappo.kinds import kind_of

    auto = getattr(transformers, kind_of(model_path).hf_auto_class)
    return auto.from_pretrained(model_path, trust_remote_code=trust_remote_code, local_files_only=True, **dtype_kw)


def _eos_ids(model) -> set[int]:
    ids: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    return ids


class HFEngine(RolloutEngine):
    """Generate from a HF causal LM in this process; update its weights in place.

    model_path: a Hugging Face directory. dtype: the compute dtype (fp32 on CPU). max_num_seqs: sequences per forward
    batch. seed: the engine's sampling stream, which seeds a request without a `seed` of its own. trust_remote_code: let
    transformers run Python code shipped with the model (config `auto_map`); off, only its own classes load.
    """

    def __init__(self, model_path: str, *, dtype: torch.dtype = torch.float32,
                 device: Union[str, torch.device] = "cpu", max_num_seqs: int = 64, seed: int = 0,
                 trust_remote_code: bool = False):
        import transformers

        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise FileNotFoundError(f"{model_path}: no config.json; the rollout engine needs a Hugging Face "
                                    f"directory (megappo convert mcore-to-hf writes one)")
        self.device = torch.device(device)
        dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        self.model = _load_model(model_path, trust_remote_code, {dtype_kw: dtype})
        self.model.to(self.device).eval()
        self.inputs = prompt_inputs(self.model)  # what a prompt's images add to a forward batch
        self.eos_ids = _eos_ids(self.model)
        self.pad_id = next(iter(sorted(self.eos_ids)), 0)  # any id: padded positions are masked
        self.max_num_seqs = max_num_seqs
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.weight_version = 0
        self._weights = HFWeightLoader(self.model)
        self._released: Optional[list] = None  # release_weights(): the freed parameters, their shapes and dtypes
        self._abort = threading.Event()  # abort(): ends the generation in flight at its next decode step
        # transformers 5 renamed the KV cache argument (past_key_values -> cache); logits_to_keep=1 spares the
        # prompt's full-vocabulary logits
        accepted = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in accepted else "past_key_values"
        self._extra_kw = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
        self._layers = num_cached_layers(self.model)
        self.routes = RouteRecorder.of(self.model)  # MoE: each token's experts, when a request asks

    # -- generation ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 prompt_offset: int = 0, multi_modal: MultiModal = None) -> list[list[Completion]]:
        """`params.n` completions for each prompt (token ids), grouped by prompt in request order.
        multi_modal: each prompt's images (None: a text prompt), for a vision-language model.

        prompt_offset: the index of `prompts[0]` in the step's batch; sample j of prompt k is drawn with the seed
        `sample_seed(params.seed, prompt_offset + k, j, n)` (the engine's stream draws a request seed when
        `params.seed` is None), so a share of the batch samples what the whole batch would."""
        check_prompts(prompts)
        self._check_weights()
        seed = params.seed
        if seed is None and params.row_seeds is None and not params.is_greedy:
            seed = int(torch.randint(0, 2**31 - 1, (), generator=self.generator, device=self.generator.device))
        seeds = request_seeds(params, len(prompts), prompt_offset, seed)
        images = self.inputs.check(prompts, multi_modal)
        rows = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(params.n)]
        self._abort.clear()  # an abort() before this call ended an earlier one
        done: list[Completion] = []
        for start in range(0, len(rows), self.max_num_seqs):
            stop = start + self.max_num_seqs
            if self._abort.is_set():  # aborted: the forward batches not started yet end empty
                done += [Completion(prompt_index=i, output_ids=[], log_probs=[], finish_reason="abort",
                                    weight_version=self.weight_version) for i, _ in rows[start:stop]]
                continue
            done += self._generate_batch(rows[start:stop], params, seeds[start:stop], images)
        grouped: list[list[Completion]] = [[] for _ in prompts]
        for c in done:
            grouped[c.prompt_index].append(c)
        return grouped

    def abort(self) -> None:
        """End the generation in flight (call it from another thread): its unfinished rows return at the next decode
        step with the tokens they have, finish_reason "abort"; forward batches not started return empty ones. A
        no-op when nothing is in flight (the next `generate` starts afresh)."""
        self._abort.set()

    def _generate_batch(self, rows: list[tuple[int, list[int]]], params: SamplingParams,
                        seeds: Sequence[Optional[int]], images: Optional[list[Optional[MultiModalInputs]]] = None
                        ) -> list[Completion]:
        """One forward batch's completions (`decode`: finished rows leave the batch), rows (prompt index, prompt
        ids) left-padded together, row r sampled with seed `seeds[r]`."""
        b, p = len(rows), max(len(ids) for _, ids in rows)
        ids = torch.full((b, p), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, p), dtype=torch.long)
        for r, (_, prompt) in enumerate(rows):
            ids[r, p - len(prompt):] = torch.tensor(prompt)
            mask[r, p - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos, vision_kw = self.inputs.prefill(ids, mask, rows, images, self.model)
        # ignore_eos ignores every stop token, as SGLang does
        stops = set() if params.ignore_eos else set(params.stop_token_ids) | self.eos_ids
        stop = torch.tensor(sorted(stops), dtype=torch.long, device=self.device)
        cache = KVCache(self._layers, p + params.max_new_tokens)
        rec = self.routes if params.return_routed_experts else None
        if self.routes is not None:  # a generation that failed part way leaves no record running
            self.routes.end()
        forward = self._forward if rec is None else rec.recording(self._forward, b)
        got = decode(forward, Prefill(ids, mask, pos, vision_kw), cache, RowSampler(params, seeds, self.device),
                     stop, params.max_new_tokens, self._abort)
        unfinished = "abort" if got.aborted else "length"
        done = []
        for r, (i, prompt) in enumerate(rows):
            fed = len(prompt) + max(len(got.tokens[r]) - 1, 0)  # a row's last token is never fed: it has no route
            done.append(Completion(prompt_index=i, output_ids=got.tokens[r], log_probs=got.log_probs[r],
                                   finish_reason="stop" if got.stopped[r] else unfinished,
                                   weight_version=self.weight_version,
                                   routed_experts=None if rec is None else rec.routes(r)[:fed]))
        if rec is not None:
            rec.end()
        return done

    def _forward(self, rows: torch.Tensor, new_mask: torch.Tensor, *, cache: KVCache, **model_kwargs):
        """Every model forward of generation, the prefill and each decode step: the model's output (logits [b, s or
        1, V]) for this forward's batch. rows [b] long: the indices of its rows into `_generate_batch`'s rows (rows
        that finished have left the batch); new_mask [b, s]: which of its s input positions are real tokens (the
        prefill's left padding is 0). model_kwargs: the model's inputs (input_ids [b, s], attention_mask or None,
        position_ids, a vision-language prefill's images); `cache` goes under the model's own keyword."""
        return self.model(**model_kwargs, use_cache=True, **{self._cache_kw: cache}, **self._extra_kw)

    # -- weights ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, tensors: Union[NamedTensors, Iterable[NamedTensors]], *, version: Optional[int] = None,
                       complete: bool = True) -> int:
        """Copy checkpoint-named tensors (pairs, or buckets of pairs as `iter_hf_weights` yields) into the model.

        complete: every parameter must have been filled (a partial sync would mix two policies). Returns the new
        weight version (`version`, else the old one + 1). Each tensor is copied into its parameter as it arrives
        and not kept, so the export's views (`iter_hf_weights(..., copy=False)`) suffice: one copy per byte.
        """
        if self._released is not None:
            if not complete:
                raise ValueError("a partial weight update cannot refill released weights (release_weights): the "
                                 "parameters it does not send would be garbage; send every parameter")
            for p, shape, dtype in self._released:  # every element is overwritten below (complete)
                p.data = torch.empty(shape, dtype=dtype, device=p.device)
        filled: dict[str, int] = {}
        for item in tensors:
            pairs = [item] if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) else item
            for name, t in pairs:
                canonical = self._weights.load(name, t)
                filled[canonical] = filled.get(canonical, 0) + t.numel()
        if complete:
            missing = self._weights.incomplete(filled)
            if missing:
                raise ValueError(f"weight update left {len(missing)} parameters unset (e.g. {missing[:4]}); the "
                                 f"exporter and the engine's model disagree")
        self._released = None
        self.weight_version = self.weight_version + 1 if version is None else version
        return self.weight_version

    def release_weights(self) -> bool:
        """Free the parameters' memory until the next complete weight update refills it (their shapes and the
        model stay; buffers such as rotary frequencies are kept): a hybrid engine's copy of the policy between its
        rollout and the trainer's next sync (`RolloutWorker.release_engine`). Generating or scoring before that
        raises. Idempotent."""
        if self._released is not None:
            return True
        # Each parameter's data is swapped for an empty tensor (its storage may come from the checkpoint's loader
        # and not be resizable); model.parameters() gives a tied parameter once.
        self._released = []
        for p in self.model.parameters():
            self._released.append((p, p.shape, p.dtype))
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return True

    def _check_weights(self) -> None:
        if self._released is not None:
            raise RuntimeError("the engine's weights were released (release_weights, rollout.free_cache_engine) "
                               "and no complete weight update has refilled them yet: sync the actor's weights first")

    def load_weights(self, buckets: Iterable[NamedTensors], *, version: int, mode: str = "tensor",
                     partial: bool = False) -> int:
        """The trainer's weight sync: the buckets' tensors copied into the model as they arrive (views suffice); a
        complete one refills released weights."""
        return self.update_weights(buckets, version=version, complete=not partial)

    def update_weights_from_disk(self, model_path: str, *, version: Optional[int] = None) -> int:
        """Load a HF directory's safetensors (same architecture) into the running model."""
        from megappo.convert.hf_io import HFCheckpoint

        ckpt = HFCheckpoint.open(model_path)
        try:
            return self.update_weights(((n, ckpt.read(n)) for n in ckpt.files), version=version)
        finally:
            ckpt.close()

    @torch.no_grad()
    def prompt_log_probs(self, token_ids: Sequence[int], *, multi_modal: Optional[MultiModalInputs] = None
                         ) -> list[list[float]]:
        """[log p(token_ids[k] | token_ids[:k]) for k >= 1] of the one model this engine holds; `multi_modal`: the
        images of a vision-language prompt."""
        self._check_weights()
        ids = torch.tensor([list(token_ids)], device=self.device)
        kw = self.inputs.scoring(ids, token_ids, multi_modal, self.model)
        logits = self.model(input_ids=ids, **kw).logits[0, :-1].float()
        return [torch.log_softmax(logits, -1).gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1).tolist()]

    @torch.no_grad()
    def sequence_log_probs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """`prompt_log_probs` of text sequences, max_num_seqs at a time in one right-padded forward each."""
        self._check_weights()
        out: list[list[float]] = []
        for start in range(0, len(sequences), self.max_num_seqs):
            chunk = [list(s) for s in sequences[start:start + self.max_num_seqs]]
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long, device=self.device)
            mask = torch.zeros_like(ids)
            for i, seq in enumerate(chunk):
                ids[i, :len(seq)], mask[i, :len(seq)] = torch.tensor(seq, device=self.device), 1
            logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)
            out += [lp[i, :len(seq) - 1].tolist() for i, seq in enumerate(chunk)]
        return out

    def close(self) -> None:
        self.shutdown_submitter()
        self.model = None
