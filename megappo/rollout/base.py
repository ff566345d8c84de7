"""One interface for every rollout engine, and the registry that picks one by `actor_rollout_ref.rollout.name`.

An engine (`RolloutEngine`) generates completions for token-id prompts, takes the actor's weights in buckets under a
version number, and answers the log-probs of given tokens (`rollout.verify_sync`). The trainer talks to engines
only through this interface: it has no branch on the engine's name.

How the engine is deployed over the trainer's ranks is the engine's business (`RolloutDeployment`): the in-process
engine is one model per data-parallel replica; SGLang is a set of servers that every node's first rank starts and
every replica shares, whose weights global rank 0 alone streams. A deployment says which engine each rank generates
with (`engine`: the first rank of each model-parallel group, the "holder") and which one it loads weights into
(`sync_target`), and runs the collective steps around a sync (restarting dead servers).

Adding an engine is a folder and one registry line, as vLLM's shows (`megappo/rollout/vllm/`): the engine class,
`deploy(settings, ps, platform) -> RolloutDeployment` (settings: the plain `megappo.rollout.settings.RolloutSettings`;
`LocalDeployment` for an engine each holder runs itself, `serving.deployment.ServedDeployment` for servers shared by
every replica) and, optionally, `preflight(cfg) -> list[str]` that refuses a run before anything starts; `ENGINES` in
`megappo/rollout/registry.py` maps the name to them and says what the engine supports. Its own knobs go in
`rollout.engine_kwargs`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

if TYPE_CHECKING:  # light to import: the trainer's preflight reads the SGLang deployment's module before torch
    import torch

    from megappo.data.multimodal import MultiModalInputs
    from megappo.rollout.sampling import Completion, SamplingParams

Bucket = list  # [(name, torch.Tensor)]: checkpoint-named tensors, as `kinds.weights.iter_hf_weights` yields them


class RolloutEngine(ABC):
    """A rollout engine as a trainer rank holds it: a model in this process, a server's client, a fleet's."""

    weight_version: int = 0  # the version of the weights it holds; its completions carry it

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: "SamplingParams", *, prompt_offset: int = 0,
                 multi_modal: Optional[Sequence[Optional["MultiModalInputs"]]] = None) -> list[list["Completion"]]:
        """`params.n` completions per prompt (token ids), grouped by prompt in request order, each exactly once.
        prompt_offset: the index of `prompts[0]` in the step's batch; sample j of prompt k is drawn with the seed
        `seeds.sample_seed(params.seed, prompt_offset + k, j, n)`, so a share of a batch samples what the whole
        batch would, whichever rank or server draws it. multi_modal: aligned with `prompts`, each prompt's images
        (`PromptBatch.multi_modal`; None for a text prompt) when the model is a vision-language one; the prompts'
        ids already hold the image tokens."""

    def submit(self, prompts: Sequence[Sequence[int]], params: "SamplingParams", **request: Any
               ) -> "Future[list[list[Completion]]]":
        """`generate(prompts, params, **request)` without waiting (request: its keywords as given, so an engine
        whose registry entry does not say `multi_modal` is never asked about images): the answer is the future's
        `result()`. Generations run one after another, in the order submitted. By default in a thread of this
        process (enough for an engine whose work happens elsewhere: servers); an engine that computes in this
        process runs them in a process of its own."""
        if getattr(self, "_submitter", None) is None:
            self._submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megappo-rollout")
        return self._submitter.submit(self.generate, prompts, params, **request)

    def continue_generation(self, prompts: Sequence[Sequence[int]], done: list[list["Completion"]],
                            params: "SamplingParams", *, prompt_offset: int = 0, round_: int = 0,
                            **request: Any) -> list[list["Completion"]]:
        """`done` (an aborted `generate`'s answer to `prompts`, `params`, `request`) with its aborted samples
        generated to their end with the weights now: each continues from its prompt and tokens with the budget it
        has left and keeps each token's version; the others stay. round_: how many continuations came before (the
        seeds of this one)."""
        from megappo.rollout.partial import continued

        return continued(self, prompts, done, params, prompt_offset, round_, request)

    def abort(self) -> None:
        """End every generation in flight: each returns at once with the tokens it has (finish_reason "abort"), so
        a partial rollout can continue from them under newer weights. Safe to call from another thread while
        `generate` runs; a no-op when nothing is in flight."""
        raise NotImplementedError(f"{type(self).__name__} cannot abort generations (partial rollouts)")

    def pause(self) -> None:
        """Hold generation for a weight update (in-flight requests wait, none is lost)."""

    def resume(self) -> None:
        """Go on after `pause`."""

    @abstractmethod
    def load_weights(self, buckets: Iterable[Bucket], *, version: int, mode: str, partial: bool = False) -> int:
        """Load the actor's weights, bucket by bucket (every parameter, or ValueError), as `version`; returns it.
        mode: the transport (rollout.weight_sync), one of the registry entry's `sync_modes`. partial: the buckets
        hold only the parameters that changed (a LoRA actor's adapted layers, merged); the others stay as loaded.
        Called between `pause` and `resume`."""

    def update_weights_from_disk(self, model_path: str, *, version: int) -> int:
        """Load a Hugging Face directory of the same architecture as `version` (rollout.weight_sync=disk)."""
        raise NotImplementedError(f"{type(self).__name__} cannot load weights from disk")

    def load_lora_adapter(self, adapter_dir: str, *, version: int) -> int:
        """Serve the PEFT adapter directory `adapter_dir` (on a filesystem the engine reads) over the base weights
        it loaded, as `version`, in place of the adapter it served; returns the version (rollout.lora_sync=adapter).
        Called between `pause` and `resume`."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve LoRA adapters")

    def check_version(self, version: int) -> None:
        """Raise when the engine does not serve `version` after an update (a server that missed it)."""

    def needs_copies(self, mode: str) -> bool:
        """True when `load_weights` (in `mode`) keeps the buckets' tensors after returning (CUDA IPC hands the
        engine their memory): the export must then give copies, not views of the parameters."""
        return False

    def release_weights(self) -> bool:
        """Free the weights' memory in this process until the next complete `load_weights` refills it (generating
        before that raises); returns whether anything was freed. The trainer calls it between a step's rollout and
        its weight sync (rollout.free_cache_engine). By default nothing: a server's memory is not the trainer's."""
        return False

    @abstractmethod
    def prompt_log_probs(self, token_ids: Sequence[int]) -> list[list[float]]:
        """log p(token_ids[k] | token_ids[:k]) for k >= 1, one list per model replica behind this engine."""

    def sequence_log_probs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """`prompt_log_probs` of each sequence from the first model replica (a distillation teacher's scoring):
        [log p(seq[k] | seq[:k]) for k >= 1] per sequence. Engines that batch override it."""
        return [self.prompt_log_probs(seq)[0] for seq in sequences]

    def close(self) -> None:
        """Release what the engine holds in this process (weight groups, a model)."""
        self.shutdown_submitter()

    def shutdown_submitter(self) -> None:
        submitter, self._submitter = getattr(self, "_submitter", None), None
        if submitter is not None:
            submitter.shutdown(wait=True, cancel_futures=True)


class RolloutDeployment:
    """An engine kind as the trainer's ranks see it. Methods other than the properties are collective: every rank
    calls them together."""

    def __init__(self, engine: Optional[RolloutEngine], sync_target: Optional[RolloutEngine]):
        self.engine = engine  # this rank's engine (the first rank of each model-parallel group; None elsewhere)
        self.sync_target = sync_target  # the engine this rank loads weights into (None: it only helps export)

    def prepare_sync(self) -> dict[str, float]:
        """Before each sync: repair what can be repaired (a dead server restarted, so the sync gives it the
        current weights); returns health metrics."""
        return self.health()

    def health(self) -> dict[str, float]:
        """Metrics of the engine's health as it stands (no repair)."""
        return {}

    def close(self) -> None:
        for engine in {id(e): e for e in (self.engine, self.sync_target) if e is not None}.values():
            engine.close()
        self.engine = self.sync_target = None


class LocalDeployment(RolloutDeployment):
    """An engine each model-parallel group's first rank runs for its replica and loads weights into itself."""

    def __init__(self, holder: bool, build: Callable[[], RolloutEngine]):
        engine = build() if holder else None
        super().__init__(engine, engine)
