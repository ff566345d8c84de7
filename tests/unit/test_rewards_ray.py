"""The Ray backend of megappo.rewards.scorer, on a real local Ray started once for the module."""
import os
import time

import pytest

ray = pytest.importorskip("ray")

from megappo.rewards import RewardScorer, ScoreItem, load_custom_reward_fn  # noqa: E402

REWARD_FILE = '''
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "raise":
        raise ValueError("bad sample")
    if solution_str == "hang":
        time.sleep(600)
    if solution_str == "exit":
        os._exit(3)
    return {"score": float(solution_str == ground_truth), "pid": os.getpid()}
'''


def items(*solutions):
    return [ScoreItem("test/source", s, "a", None) for s in solutions]


def test_unreachable_cluster_names_the_setting(monkeypatch):
    # Runs first, before this module starts Ray: "auto" with no cluster on this machine fails fast.
    if ray.is_initialized() or os.path.exists("/tmp/ray/ray_current_cluster"):
        pytest.skip("a Ray cluster is running on this machine, so address=auto would join it")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConnectionError, match="reward_model.ray_address='auto'.*ray start --head"):
        RewardScorer(None, backend="ray", ray_address="auto").score(items("a"))
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def ray_scorer(tmp_path_factory):
    if ray.is_initialized():
        pytest.skip("another test left Ray running; this module checks that the scorer starts its own")
    path = tmp_path_factory.mktemp("reward") / "reward.py"
    path.write_text(REWARD_FILE)
    fn = load_custom_reward_fn(str(path))
    scorer = RewardScorer(fn, num_workers=2, backend="ray", timeout_s=5.0, failure_score=-1.0)
    scorer.score([ScoreItem("s", "a", "a")])  # starts the local Ray (the module's only ray.init)
    assert ray.is_initialized()
    yield scorer
    scorer.close()
    assert not ray.is_initialized(), "the scorer started Ray, so its close() must shut it down"




def test_ray_scores_in_worker_processes(ray_scorer):
    res = ray_scorer.score(items("a", "b", "a", "c"))
    assert res.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert res.num_failed == 0 and res.num_timeout == 0
    assert os.getpid() not in res.extras["pid"].tolist()  # the file was re-imported in Ray workers


def test_ray_failures_and_timeouts_do_not_stop_the_batch(ray_scorer):
    start = time.monotonic()
    res = ray_scorer.score(items("a", "raise", "hang", "exit", "a"))
    assert time.monotonic() - start < 20  # the hang costs its 5 s timeout, not 600 s
    assert res.scores.tolist() == [1.0, -1.0, -1.0, -1.0, 1.0]
    assert res.failed.tolist() == [False, True, False, True, False]
    assert res.timed_out.tolist() == [False, False, True, False, False]
    # Ray replaces the cancelled and crashed workers.
    assert ray_scorer.score(items("a", "b")).scores.tolist() == [1.0, 0.0]


def test_a_second_scorer_reuses_the_running_ray(ray_scorer):
    with RewardScorer(None, num_workers=1, backend="ray") as other:
        res = other.score([ScoreItem("openai/gsm8k", "#### 7", "7")])
        assert res.scores.tolist() == [1.0]
    assert ray.is_initialized(), "a scorer that joined a running Ray must leave it running"
