"""The asynchronous schedules on a real CPU SGLang server the trainer starts: the main job's recipes with
rollout.name=sglang. one_step_off generates the next batch while the trainer trains and trains it one version
behind; fully_async (syncs every 2 steps, half a window ahead, partial rollouts) keeps its staleness within the
bound; both learn like the synchronous main job within its 20
steps, and the server is stopped at the end."""
from __future__ import annotations

import subprocess

import pytest

from megappo.config import load_config
from megappo.testing.prompts import read_metrics
from megappo.testing.recipes import learned
from megappo.trainer import fit
from megappo.trainer.metrics import read_steps

pytestmark = [pytest.mark.e2e, pytest.mark.sglang]


def _servers(run_dir) -> list[str]:
    """The SGLang servers serving a model of `run_dir` (the synthetic task's model is written there)."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "sglang.launch_server" in line and str(run_dir) in line]


# long: the recipes learn with the in-process engine (tests/e2e/test_recipes_cpu.py), and fully_async on SGLang runs
# in the default tier below (partial rollouts; a server killed mid-generation)
@pytest.mark.long
@pytest.mark.parametrize("recipe", ["tiny_ppo_one_step_off", "tiny_ppo_async"])
def test_async_recipes_on_sglang_learn(sglang_python, tmp_path, monkeypatch, recipe):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    extra: list[str] = []
    cfg = load_config(f"cpu/{recipe}", [
        f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[]",
        "actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.rollout.server_python={sglang_python}", *extra])
    cfg.actor_rollout_ref.rollout.engine_kwargs = {}  # the recipes' threads are the in-process engine's
    # the recipes' checkpoints stay: SGLang samples differently from run to run, and a step whose policy moves past
    # the KL guard's threshold is rolled back to one and retried, as in a user's run
    assert fit(cfg) == 0
    rows = read_steps(str(tmp_path / "run"))  # a retried step counts once, by its retry
    assert [r["step"] for r in rows][-1] == 20
    steps = [r for r in rows if r["step"] > 0]
    bound = 1.0
    assert max(r["async/staleness_max"] for r in steps) == bound and steps[0]["async/staleness_max"] == 0.0
    assert learned(rows) >= 0.3, [r["reward/mean"] for r in steps]
    assert _servers(tmp_path) == []  # the trainer stopped the server it started


def test_partial_rollout_on_sglang_continues_with_the_new_weights(sglang_python, hf_model_dir, tmp_path):
    """The producer on a real server (through the fleet, as the trainer has it): a sync's pause aborts the
    generation in progress, the server answers with the tokens each sample has; after the weights change (version
    1) every sample continues from its tokens on the new weights, keeps its first token's version (0) and is marked
    partial. Greedy, so the continuation is checked against the new model's own."""
    from megappo.rollout.sglang.fleet import SGLangFleet
    from megappo.rollout.sglang.server import SGLangServer
    from megappo.testing.completions import assert_continued_on_new_weights, partial_rollout_across_sync
    from megappo.testing.hf_models import make_hf_model

    old, new = hf_model_dir("qwen2"), make_hf_model("qwen2", str(tmp_path / "new"), seed=1)
    prompts, budget = [[5, 6, 7], [9, 10, 11, 12]], 400  # the tiny model's context is 512
    with SGLangServer(old, python=sglang_python) as server:
        fleet = SGLangFleet([server.url])
        try:  # a few hundred tokens a second here: 0.3 s is some tokens in, far from the end
            partial, groups = partial_rollout_across_sync(
                fleet, prompts, budget, 0.3, lambda: fleet.update_weights_from_disk(new, version=1))
        finally:
            fleet.close()
    assert_continued_on_new_weights(prompts, partial, groups, old, new, budget, (0, 1))


# long (about 2 minutes): the fleet sending a killed server's share to another is tests/e2e/test_sglang_fleet.py's,
# the async queue's exact data order tests/e2e/test_fully_async.py's
@pytest.mark.long
def test_fully_async_loses_no_sample_to_a_server_killed_mid_generation(sglang_python, tmp_path, monkeypatch):
    """Two started servers; one is SIGKILLed while the producer's request for step 3's batch is in it. The fleet
    sends that share to the other server (same seeds), so every step trains exactly its batch of the data order;
    the next sync restarts the dead server and gives it the weights, and the last steps use both again."""
    import http.client
    import os
    import signal
    import threading
    import time

    import psutil

    from megappo.data.loader import EpochSampler
    from megappo.rollout.sglang.engine import SGLangEngine
    from megappo.trainer import phases

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_config("cpu/tiny_ppo_async", [
        f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[]", "trainer.save_freq=-1",
        "trainer.total_training_steps=5", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.rollout.server_python={sglang_python}",
        "actor_rollout_ref.rollout.servers_per_node=2", "async_training.trigger_parameter_sync_step=1",
        "async_training.staleness_threshold=1", "async_training.partial_rollout=false",
        "data.max_response_length=48", "actor_rollout_ref.rollout.ignore_eos=true",  # requests of ~0.4 s
        # The tiny model learned to answer in a few tokens; 48 forced tokens past its EOS are where it is most
        # sensitive: at the recipe's lr of 1e-3, about one run in four drew a first batch whose first Adam step moved
        # the policy by a KL of 2.3 (deterministic given that batch: replaying it gave the same), and the KL guard
        # rightly stopped the run. This test is about samples, not learning, so it takes a step 10x smaller.
        "actor_rollout_ref.actor.optim.lr=1e-4"])
    cfg.actor_rollout_ref.rollout.engine_kwargs = {}
    seen: list = []
    real_experience, real_rows = phases.make_experience, SGLangEngine.generate_rows
    calls: dict = {}

    def make_experience(run, samples, scores):
        seen.append(sorted(set(samples.dataset_indices)))
        return real_experience(run, samples, scores)

    in_flight: dict = {}  # thread -> the pid of the server to kill once that thread's request is sent
    real_getresponse = http.client.HTTPConnection.getresponse

    def generate_rows(self, *args, **kwargs):
        calls[self.url] = calls.get(self.url, 0) + 1
        if calls[self.url] == 3 and "killed" not in calls:  # the second server's share of the third batch
            calls["killed"] = self.url
            port = self.url.rsplit(":", 1)[1]
            victim = next(p for p in psutil.Process().children(recursive=True)
                          if "sglang.launch_server" in " ".join(p.cmdline()) and port in p.cmdline())
            in_flight[threading.get_ident()] = victim.pid
        return real_rows(self, *args, **kwargs)

    def getresponse(conn, *args, **kwargs):
        # The request is sent and its answer (~0.4 s of generation) not begun: the server dies with it in flight
        # (a timer started with the call could fire after a quick answer, and nothing would be retried)
        pid = in_flight.pop(threading.get_ident(), None)
        if pid is not None:
            os.killpg(pid, signal.SIGKILL)
        return real_getresponse(conn, *args, **kwargs)

    monkeypatch.setattr(phases, "make_experience", make_experience)
    monkeypatch.setattr(SGLangEngine, "generate_rows", generate_rows)
    monkeypatch.setattr(http.client.HTTPConnection, "getresponse", getresponse)
    started = time.time()
    assert fit(cfg) == 0
    assert "killed" in calls, "no server was killed"
    order = EpochSampler(cfg.data.synthetic.num_train_prompts, cfg.data.train_batch_size, seed=cfg.data.seed)
    assert seen == [sorted(order.batch(0, k).tolist()) for k in range(5)]  # each batch once, in order
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["rollout/server_restarts"] >= 1 and rows[-1]["rollout/servers_live"] == 2
    assert rows[-1]["rollout/retried_samples"] > 0  # the killed server's share went to the other one
    assert all(r["response/length_mean"] == 48 for r in rows)  # every sample whole
    assert _servers(tmp_path) == [] and time.time() - started < 300
