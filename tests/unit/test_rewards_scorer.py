"""megappo.rewards.scorer: batch scoring in worker processes; failures and timeouts never stop a batch."""
import os
import time

import pytest
import torch

from megappo.rewards import RewardFunctionError, RewardScorer, ScoreItem, load_custom_reward_fn

# A user reward file: the solution string picks a behaviour, otherwise exact match scores 1.
REWARD_FILE = '''
import os, subprocess, sys, time

def compute_score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "raise":
        raise ValueError("bad sample")
    if solution_str == "hang":
        time.sleep(600)
    if solution_str == "hang_with_child":  # a sandbox-like child that must die with its worker
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(extra_info["pid_file"], "w") as f:
            f.write(str(child.pid))
        child.wait()
    if solution_str == "exit":
        os._exit(3)
    if solution_str == "text":
        return "not a number"
    if solution_str == "nan":
        return float("nan")
    return {"score": float(solution_str == ground_truth), "length": len(solution_str), "pred": solution_str}
'''


@pytest.fixture(scope="module")
def reward_fn(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "reward.py"
    path.write_text(REWARD_FILE)
    return load_custom_reward_fn(str(path), "compute_score")


def items(*solutions, truth="a"):
    return [ScoreItem("test/source", s, truth, {}) for s in solutions]


def test_serial_scores_extras_and_failures(reward_fn):
    with RewardScorer(reward_fn, backend="serial", failure_score=-1.0) as scorer:
        res = scorer.score(items("a", "b", "raise", "text", "nan", "abc"))
    assert res.scores.tolist() == [1.0, 0.0, -1.0, -1.0, -1.0, 0.0]
    assert res.failed.tolist() == [False, False, True, True, True, False]
    assert res.num_failed == 3 and res.num_timeout == 0
    # Numeric extras become [B] metrics (NaN where a sample gave none); the string "pred" is dropped.
    assert set(res.extras) == {"length"}
    assert torch.equal(res.extras["length"].isnan(), torch.tensor([False, False, True, True, True, False]))
    assert "ValueError: bad sample" in res.errors[0]
    m = res.metrics()
    assert m["reward/num_failed"] == 3.0 and m["reward/length"] == pytest.approx(5 / 3)


def test_process_backend_survives_raise_exit_and_hang(reward_fn):
    batch = items("a", "raise", "hang", "b", "exit", "a", "hang", "a")
    with RewardScorer(reward_fn, num_workers=2, backend="process", timeout_s=2.0, failure_score=0.5) as scorer:
        scorer.score(items("a"))  # start the workers outside the timed part
        start = time.monotonic()
        res = scorer.score(batch)
        elapsed = time.monotonic() - start
        assert res.scores.tolist() == [1.0, 0.5, 0.5, 0.0, 0.5, 1.0, 0.5, 1.0]
        assert res.timed_out.tolist() == [False, False, True, False, False, False, True, False]
        assert res.failed.tolist() == [False, True, False, False, True, False, False, False]
        assert res.num_timeout == 2 and res.num_failed == 2
        assert any("worker died (exit code 3)" in e for e in res.errors)
        assert elapsed < 15, f"hung samples were waited for: {elapsed:.1f}s"
        # The killed and crashed workers were replaced: the scorer keeps working.
        assert scorer.score(items("a", "b", "a")).scores.tolist() == [1.0, 0.0, 1.0]


def test_timeout_kills_the_workers_children(reward_fn, tmp_path):
    pid_file = tmp_path / "child.pid"
    item = ScoreItem("test/source", "hang_with_child", "a", {"pid_file": str(pid_file)})
    with RewardScorer(reward_fn, num_workers=1, backend="process", timeout_s=2.0) as scorer:
        res = scorer.score([item])
    assert res.num_timeout == 1
    child = int(pid_file.read_text())
    for _ in range(50):  # the kill is asynchronous; the child is gone once init reaps it
        if not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the hung reward function's child process {child} outlived the timeout")


def test_registry_function_by_default():
    with RewardScorer(None, num_workers=2, backend="process", timeout_s=30) as scorer:
        res = scorer.score([ScoreItem("openai/gsm8k", "#### 1,234", "1234"), ScoreItem("openai/gsm8k", "42", "42"),
                            ScoreItem("unknown/source", "#### 1", "1")])
    assert res.scores.tolist() == [1.0, 0.0, 0.0]
    assert res.failed.tolist() == [False, False, True]
    assert "no reward function is registered for data_source 'unknown/source'" in res.errors[0]


def test_configuration_errors(reward_fn, tmp_path):
    with pytest.raises(ValueError, match="cannot be sent to worker processes.*backend=serial"):
        RewardScorer(lambda *a: 1.0, backend="process")
    assert RewardScorer(lambda *a: 1.0, backend="serial").score(items("x")).scores.tolist() == [1.0]
    with pytest.raises(ValueError, match="process, ray or serial"):
        RewardScorer(None, backend="threads")
    with pytest.raises(ValueError, match="num_workers"):
        RewardScorer(None, num_workers=0)
    # A function that loaded here but not in the worker (the file went away) is a configuration error.
    path = tmp_path / "gone.py"
    path.write_text("def compute_score(*a):\n    return 1.0\n")
    fn = load_custom_reward_fn(str(path))
    path.unlink()
    with RewardScorer(fn, num_workers=1, backend="process") as scorer:
        with pytest.raises(RewardFunctionError, match="could not load the reward function.*does not exist"):
            scorer.score(items("x"))
    # A worker that dies while starting is not replaced forever: the run is told why.
    path = tmp_path / "dies_in_worker.py"
    path.write_text("import multiprocessing, os\nif multiprocessing.parent_process() is not None:\n"
                    "    os._exit(4)\ndef compute_score(*a):\n    return 1.0\n")
    with RewardScorer(load_custom_reward_fn(str(path)), num_workers=1, backend="process") as scorer:
        with pytest.raises(RuntimeError, match=r"exited \(code 4\) before it was ready"):
            scorer.score(items("x"))
    assert RewardScorer(None, backend="serial").score([]).scores.shape == (0,)
