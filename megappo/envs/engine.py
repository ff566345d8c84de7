"""The engine a holder generates with when its samples are episodes: `generate` runs `EpisodeRollout` over the
deployment's engine (every other call goes to that engine, which the weights are loaded into)."""
from __future__ import annotations

from typing import Optional, Sequence

from megappo.envs.base import EpisodeRow
from megappo.envs.loop import EpisodeRollout, EpisodeSettings
from megappo.envs.registry import LoopKinds
from megappo.rollout.base import RolloutEngine
from megappo.rollout.sampling import Completion, SamplingParams


class EpisodeEngine(RolloutEngine):
    """An engine whose `generate` runs each sample as its row's agent's episode over another engine."""

    takes_rows = True  # its requests carry the prompts' dataset rows (`rows=`)

    def __init__(self, inner: RolloutEngine, loop: EpisodeRollout):
        self.inner, self.loop = inner, loop

    @property
    def weight_version(self) -> int:  # type: ignore[override]
        return self.inner.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.inner.weight_version = version

    def generate(self, prompts, params, *, prompt_offset: int = 0, rows: Optional[Sequence[EpisodeRow]] = None,
                 **request):
        return self.loop.generate(self.inner, prompts, params, prompt_offset=prompt_offset, rows=rows)

    def continue_generation(self, prompts: Sequence[Sequence[int]], done: list[list[Completion]],
                            params: SamplingParams, *, prompt_offset: int = 0, round_: int = 0,
                            **request) -> list[list[Completion]]:
        """The paused episodes of `done` go on with the engine's weights now (each token keeps its version)."""
        return self.loop.resume(self.inner, done)

    def abort(self) -> None:
        self.loop.abort()
        self.inner.abort()

    def pause(self) -> None:
        self.inner.pause()

    def resume(self) -> None:
        self.inner.resume()

    def load_weights(self, buckets, *, version: int, mode: str, partial: bool = False) -> int:
        return self.inner.load_weights(buckets, version=version, mode=mode, partial=partial)

    def update_weights_from_disk(self, model_path: str, *, version: int) -> int:
        return self.inner.update_weights_from_disk(model_path, version=version)

    def load_lora_adapter(self, adapter_dir: str, *, version: int) -> int:
        return self.inner.load_lora_adapter(adapter_dir, version=version)

    def check_version(self, version: int) -> None:
        self.inner.check_version(version)

    def needs_copies(self, mode: str) -> bool:
        return self.inner.needs_copies(mode)

    def prompt_log_probs(self, token_ids):
        return self.inner.prompt_log_probs(token_ids)

    def close(self) -> None:
        """The loop's threads and agents; the engine itself is its deployment's to close."""
        self.shutdown_submitter()
        self.loop.close()


def build_episodes(settings: EpisodeSettings, engine: RolloutEngine, kinds: LoopKinds) -> EpisodeEngine:
    """The holder's engine wrapped in the episode loop of the run's agent loops (`kinds`: what they can be)."""
    from transformers import AutoTokenizer

    from megappo.chat.template import TemplateIgnoresTools
    from megappo.envs.registry import agent_loops

    tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path, trust_remote_code=settings.trust_remote_code)
    table = agent_loops(settings, tokenizer, kinds)
    try:
        if table.default:
            table.get(table.default)  # made now: a config error is said at setup, not at the first step
    except TemplateIgnoresTools as e:  # a config error: the preflight could not check a tokenizer made later
        from megappo.config import ConfigError

        raise ConfigError([f"actor_rollout_ref.rollout.multi_turn.enable: {e}"]) from None
    return EpisodeEngine(engine, EpisodeRollout(settings, table))
