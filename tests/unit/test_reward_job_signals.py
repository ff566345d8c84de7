"""Reward workers are the trainer's helpers: a job-wide signal (Slurm's preemption SIGTERM, SIGUSR1, SIGINT to every
process of the job) does not end them under the trainer's step; the trainer's close() still ends them at once, and
a Ray started for them leaves the trainer's own SIGTERM handler in place."""
import os
import signal
import time

import pytest

from megappo.rewards import RewardScorer, ScoreItem

ITEMS = [ScoreItem("openai/gsm8k", "#### 3", "3"), ScoreItem("openai/gsm8k", "#### 4", "3")]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
def test_process_workers_outlive_job_wide_signals_and_close_ends_them():
    scorer = RewardScorer(num_workers=2, backend="process", timeout_s=60)
    try:
        assert scorer.score(ITEMS).scores.tolist() == [1.0, 0.0]
        pids = [w.proc.pid for w in scorer._pool._workers]
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            for pid in pids:
                os.kill(pid, sig)
        time.sleep(1)
        assert all(_alive(p) for p in pids), "a reward worker died of a job-wide signal"
        result = scorer.score(ITEMS)
        assert result.scores.tolist() == [1.0, 0.0] and result.num_failed == 0
        assert [w.proc.pid for w in scorer._pool._workers] == pids  # none was replaced
    finally:
        t0 = time.monotonic()
        scorer.close()
    assert time.monotonic() - t0 < 10
    assert not any(_alive(p) for p in pids)


@pytest.mark.timeout(300)
def test_a_local_ray_keeps_the_trainers_sigterm_handler():
    pytest.importorskip("ray")
    import ray

    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process")
    got = []

    def handler(signum, _frame):
        got.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    scorer = RewardScorer(num_workers=1, backend="ray", timeout_s=60)
    try:
        assert scorer.score(ITEMS[:1]).scores.tolist() == [1.0]
        assert signal.getsignal(signal.SIGTERM) is handler  # ray.init's sys.exit handler was put back
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        assert got == [signal.SIGTERM]
    finally:
        scorer.close()
        signal.signal(signal.SIGTERM, previous)
