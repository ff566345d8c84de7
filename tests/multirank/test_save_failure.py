"""A checkpoint save that fails on one rank only (its disk, its quota) ends the run within seconds on every rank,
with a message naming the cause and the intact previous checkpoint, instead of leaving the other ranks waiting
forever inside megatron's save; the next start removes the unfinished directory and resumes from that checkpoint."""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from megappo.testing import hf_models

pytestmark = pytest.mark.multirank


def _job(rank, world_size, hf_dir, local_dir):
    import errno

    import torch

    from megappo.kinds.build import build_model
    from megappo.models.lora import FullParameters
    from megappo.parallel import init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.trainer import checkpointing

    platform = detect_platform()
    ps = init_parallel(ParallelLayout(), platform, seed=0)  # DP2
    actor = SimpleNamespace(name="actor", chunks=build_model(hf_dir, "actor", ps, platform, seed=3), optimizer=None,
                            adapter=FullParameters(), scheduler=SimpleNamespace(state_dict=lambda: {"step": 0}))
    run = SimpleNamespace(roles=SimpleNamespace(actor=actor, critic=None), ps=ps)
    checkpointing.save(run, local_dir, 1, {"data": 1}, max_keep=None)
    if rank == 0:  # rank 0 alone writes megatron's common.pt: its disk filling up is invisible to rank 1
        real_save = torch.save

        def save_on_a_full_disk(obj, f, *args, **kwargs):
            if str(f).endswith("common.pt"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
            return real_save(obj, f, *args, **kwargs)

        torch.save = save_on_a_full_disk
    checkpointing.save(run, local_dir, 2, {"data": 2}, max_keep=None)
    return "saved"


def test_a_save_failing_on_one_rank_stops_every_rank_at_once(tmp_path, capfd):
    from megappo.testing.dist import RankFailed, run_distributed
    from megappo.trainer import checkpointing

    hf_dir = hf_models.make_hf_model("qwen2", str(tmp_path / "hf"))
    local_dir = str(tmp_path / "run")
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        run_distributed(_job, 2, hf_dir, local_dir, timeout=120, start_method="spawn")  # capfd reads them
    assert time.monotonic() - t0 < 60, "the ranks waited for each other instead of stopping"
    err = capfd.readouterr().err
    step1 = checkpointing.step_dir(local_dir, 1)
    assert "[rank 0] megappo train: saving the step-2 checkpoint" in err
    assert "No space left on device" in err and f"the previous checkpoint {step1} is intact" in err
    assert "start the same command again to resume" in err
    # rank 1 says why it stops too (under torchrun its agent would stop it as well)
    assert "another rank stopped while this one waited for it" in err
    assert "exited with code 1 without a result" in str(failed.value)

    assert checkpointing.latest_step(local_dir) == 1
    root = checkpointing.checkpoint_root(local_dir)
    assert any(".tmp-" in d for d in os.listdir(root))  # what the failed save left ...
    checkpointing.remove_stale(local_dir)  # ... the next start removes
    assert sorted(os.listdir(root)) == ["global_step_1", checkpointing.TRACKER]
    assert os.path.isfile(os.path.join(step1, "actor", "megappo_checkpoint.json"))


def _export_job(rank, world_size, hf_dir, out_dir):
    import errno

    from megappo.convert import hf_io
    from megappo.kinds.build import build_model
    from megappo.kinds.weights import iter_hf_weights
    from megappo.models.checkpoint import CheckpointError
    from megappo.models.hf_config import load_hf_config_dict
    from megappo.parallel import init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout
    from megappo.trainer.checkpointing import write_actor_hf_dir

    platform = detect_platform()
    ps = init_parallel(ParallelLayout(tp=2), platform, seed=0)
    chunks = build_model(hf_dir, "actor", ps, platform, seed=3)
    if rank == 0:  # the disk fills up after the first tensor, while rank 1 still gathers the next buckets
        real_add = hf_io.ShardedSafetensorsWriter.add

        def add(self, name, tensor):
            if self.num_tensors >= 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_add(self, name, tensor)

        hf_io.ShardedSafetensorsWriter.add = add
    hf_config = load_hf_config_dict(hf_dir)
    try:
        write_actor_hf_dir(iter_hf_weights(chunks, ps, hf_config, bucket_bytes=1), hf_config, hf_dir, out_dir, None)
    except CheckpointError as e:
        return str(e)
    return "written"


def test_an_export_failing_on_rank_0_fails_on_every_rank(tmp_path):
    from megappo.testing.dist import run_distributed

    hf_dir = hf_models.make_hf_model("qwen2", str(tmp_path / "hf"))
    out_dir = str(tmp_path / "export")
    messages = run_distributed(_export_job, 2, hf_dir, out_dir, timeout=120)
    assert all(f"writing the actor's Hugging Face export to {out_dir} failed" in m for m in messages), messages
    assert "No space left on device" in messages[0] and "on another rank" in messages[1]
    assert not os.path.exists(out_dir)
