"""async_training.mode=fully_async on CPU (the engine in its own process): a producer generates the next steps'
batches within the staleness budget while the trainer trains, the weights are synced every
trigger_parameter_sync_step steps, and every prompt is trained once.

- With W = 1 and staleness_threshold 1 the schedule is one_step_off's, and so are the numbers, exactly.
- W = 2, threshold 0.5, partial rollouts: each step trains the batch a synchronous run trains at that step, syncs
  happen at even steps only, and no batch is staler than the bound (1).
- Stopped (a preemption's save) and resumed: no prompt lost or trained twice, and the batches generated ahead come
  back from the checkpoint; resumed under a tighter threshold, the ones now too stale are dropped and generated
  again (async/dropped_stale).
- The producer's partial rollout: a sync aborts the generation in progress, and its samples continue from their
  tokens with the new weights, each token keeping the version that produced it."""
from __future__ import annotations

from pathlib import Path

import pytest

from megappo.config import load_config
from megappo.testing.prompts import read_metrics
from megappo.trainer import fit, phases
from megappo.trainer.preemption import StopRequest

pytestmark = pytest.mark.e2e
ASYNC = ["actor_rollout_ref.hybrid_engine=false"]
BASE = ["trainer.logger=[]", "data.synthetic.warm_start_steps=30", "data.train_batch_size=16",
        "data.synthetic.num_train_prompts=128", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1"]
FULLY = ["async_training.mode=fully_async", *ASYNC]


def _cfg(out: Path, steps: int, *extra: str):
    return load_config("cpu/tiny_ppo", [f"trainer.default_local_dir={out}", f"trainer.total_training_steps={steps}",
                                        *BASE, *extra])


def _recorded(monkeypatch) -> list[tuple[int, tuple[int, ...]]]:
    """(step, the dataset indices of the prompts it trained on) for every experience made."""
    seen: list = []
    real = phases.make_experience

    def make_experience(run, samples, scores):
        seen.append((run.state.step + 1, tuple(sorted(set(samples.dataset_indices)))))
        return real(run, samples, scores)

    monkeypatch.setattr(phases, "make_experience", make_experience)
    return seen


@pytest.fixture(scope="module")
def sync_batches(tmp_path_factory) -> list:
    """What a synchronous run of 6 steps trains on, step by step."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("OMP_NUM_THREADS", "1")
        seen = _recorded(m)
        assert fit(_cfg(tmp_path_factory.mktemp("fully_async_sync") / "sync", 6)) == 0
    return list(seen)


def _numbers(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/", "async/"))}
            for r in read_metrics(str(out))]


def test_one_window_one_batch_ahead_is_one_step_off(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert fit(_cfg(tmp_path / "osl", 4, "async_training.mode=one_step_off", *ASYNC)) == 0
    assert fit(_cfg(tmp_path / "fa", 4, *FULLY, "async_training.staleness_threshold=1",
                    "async_training.trigger_parameter_sync_step=1")) == 0
    assert _numbers(tmp_path / "fa") == _numbers(tmp_path / "osl")
    # the critic values each batch one update after the actor that generated it (the first: the same one)
    assert [r["async/critic_staleness_max"] for r in read_metrics(str(tmp_path / "osl"))] == [0, 1, 1, 1]


def test_windows_of_two_steps_with_partial_rollouts(sync_batches, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    seen = _recorded(monkeypatch)
    assert fit(_cfg(tmp_path / "fa", 6, *FULLY, "async_training.staleness_threshold=0.5",
                    "async_training.trigger_parameter_sync_step=2", "async_training.partial_rollout=true")) == 0
    assert seen == sync_batches  # each prompt once, at the step a synchronous run trains it
    rows = read_metrics(str(tmp_path / "fa"))
    assert [r.get("rollout/weight_version") for r in rows] == [None, 1.0, None, 2.0, None, 3.0]
    assert max(r["async/staleness_max"] for r in rows) <= 1.0  # floor((2 - 1 + 1) / 2)
    # in updates: a batch of the engines' version is up to W - 1 = 1 update behind, one ahead of it W more
    assert [r["async/critic_staleness_max"] for r in rows][:2] == [0, 1]
    assert max(r["async/critic_staleness_max"] for r in rows) == 2
    assert all(r["async/dropped_stale"] == 0 for r in rows)
    assert all(0 <= r["async/partial_fraction"] <= 1 for r in rows)


def _stop_after(monkeypatch, seen: list, steps: int) -> None:
    """The run stops (as on SIGTERM: save, exit 75) once `steps` steps have made their experience."""
    monkeypatch.setattr(StopRequest, "reason", lambda self: "a test's stop" if len(seen) >= steps else None)


def test_stopped_and_resumed_trains_every_prompt_once(sync_batches, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    seen = _recorded(monkeypatch)
    cfg = ["async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=1", *FULLY]
    with monkeypatch.context() as m:
        _stop_after(m, seen, 2)
        assert fit(_cfg(tmp_path / "fa", 6, *cfg)) == 75
    assert fit(_cfg(tmp_path / "fa", 6, *cfg)) == 0
    assert seen == sync_batches  # steps 1-2, then 3-6 after the resume: nothing lost, nothing twice
    rows = read_metrics(str(tmp_path / "fa"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert max(r["async/staleness_max"] for r in rows) <= 1.0
    # batches still generating at the save (episodes in flight among them) were generated again from their rows,
    # said once, at the resumed run's first step: whole batches of 16 samples
    restarted = [r["async/restarted_samples"] for r in rows]
    assert restarted[2] % 16 == 0 and restarted[:2] == [0, 0] and restarted[3:] == [0, 0, 0]


def test_resumed_under_a_tighter_threshold_drops_and_regenerates_the_stale_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    seen = _recorded(monkeypatch)
    loose = ["async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=1", *FULLY]
    with monkeypatch.context() as m:
        _stop_after(m, seen, 2)
        assert fit(_cfg(tmp_path / "fa", 4, *loose)) == 75
    tight = [c.replace("staleness_threshold=1", "staleness_threshold=0") for c in loose]
    assert fit(_cfg(tmp_path / "fa", 4, *tight)) == 0
    rows = read_metrics(str(tmp_path / "fa"))
    assert rows[2]["step"] == 3 and rows[2]["async/dropped_stale"] == 16  # the checkpoint's batch: all its prompts
    assert rows[2]["async/staleness_max"] == 0.0 and rows[3]["async/staleness_max"] == 0.0
    assert [s for s, _ in seen] == [1, 2, 3, 4] and len({b for _, b in seen}) == 4


def test_partial_rollout_continues_aborted_samples_with_new_weights(hf_model_dir):
    """The producer on the in-process engine: a pause mid-generation aborts it; after the weights change, the
    samples continue from their tokens, marked partial, with their first token's version."""
    import time

    import torch

    from megappo.rollout import HFEngine, SamplingParams
    from megappo.trainer.async_rollout import Producer, _Job

    torch.set_num_threads(1)
    engine = HFEngine(hf_model_dir("qwen2"), seed=0)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True, n=2, seed=7)
    producer = Producer(engine, partial=True)
    calls: list = []

    def sync_arrives(*_):  # at the 8th forward (a few decode steps in), a sync pauses the producer: abort
        calls.append(1)
        if len(calls) == 8:
            with producer.cv:
                producer.paused = True
            engine.abort()

    hook = engine.model.register_forward_hook(sync_arrives)
    try:
        job = _Job([[1, 2, 3], [4, 5]], params, 0)
        future = producer.put(job)
        deadline = time.monotonic() + 120
        while job.done is None and time.monotonic() < deadline:
            time.sleep(0.01)
        partial = job.done
        assert partial is not None and not future.done()
        assert all(c.finish_reason == "abort" and 0 < len(c.output_ids) < 64 for g in partial for c in g)
        engine.weight_version = 5  # the sync
        producer.resume()
        groups = future.result(timeout=120)
    finally:
        hook.remove()
        producer.close()
    for before, group in zip(partial, groups):
        assert len(group) == 2
        for b, c in zip(before, group):
            assert c.output_ids[:len(b.output_ids)] == b.output_ids  # continued from its tokens
    for group in groups:
        assert len(group) == 2
        for c in group:
            assert len(c.output_ids) == 64 and len(c.log_probs) == 64 and c.finish_reason == "length"
            assert c.extra["partial"] and c.weight_version == 0
            # each token keeps the version that produced it: the aborted part 0, the rest the sync's
            k = c.token_versions.index(5)
            assert k > 0 and c.token_versions == [0] * k + [5] * (64 - k)
