"""Adding a rollout engine is one file and one registry entry: an engine module the trainer has never heard of, put
in `megappo.rollout.registry.ENGINES`, is deployed, generates, takes every weight sync under its version, and trains
exactly as the built-in engine it wraps. Unknown names and transports are refused before anything starts, naming
the registered engines."""
from __future__ import annotations

import sys
import textwrap

import pytest

from megappo.config import ConfigError, load_config
from megappo.rollout import registry
from megappo.testing.prompts import read_metrics
from megappo.trainer import fit
from megappo.trainer.preflight import preflight

pytestmark = pytest.mark.e2e

TOY = textwrap.dedent('''
    """A toy engine: the in-process engine behind the interface, recording what the trainer asked of it."""
    import torch.distributed as dist

    from megappo.rollout.base import LocalDeployment, RolloutEngine
    from megappo.rollout.hf.engine import HFEngine

    CALLS = []


    class ToyEngine(RolloutEngine):
        def __init__(self, path):
            self.inner = HFEngine(path, seed=1)

        def generate(self, prompts, params, *, prompt_offset=0):
            CALLS.append(("generate", len(prompts), self.weight_version))
            return self.inner.generate(prompts, params, prompt_offset=prompt_offset)

        def pause(self):
            CALLS.append(("pause",))

        def resume(self):
            CALLS.append(("resume",))

        def load_weights(self, buckets, *, version, mode):
            CALLS.append(("load_weights", version, mode))
            self.weight_version = self.inner.load_weights(buckets, version=version, mode=mode)
            return self.weight_version

        def check_version(self, version):
            assert self.weight_version == version

        def prompt_log_probs(self, token_ids):
            return self.inner.prompt_log_probs(token_ids)


    def deploy(settings, ps, platform):
        return LocalDeployment(dist.get_rank(ps.mp_group) == 0, lambda: ToyEngine(settings.model_path))
''')
OVERRIDES = ["trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.logger=[]",
             "trainer.val_before_train=false", "data.synthetic.warm_start_steps=20"]


@pytest.fixture
def toy(tmp_path, monkeypatch):
    (tmp_path / "toy_engine.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.ENGINES, "toy", {"deploy": "toy_engine:deploy", "sync_modes": ("tensor",)})
    yield
    sys.modules.pop("toy_engine", None)


def test_a_registered_engine_trains_like_the_one_it_wraps(toy, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rows = {}
    for name in ("hf", "toy"):
        out = tmp_path / name
        cfg = load_config("cpu/tiny_ppo", [f"trainer.default_local_dir={out}", f"actor_rollout_ref.rollout.name={name}",
                                           "actor_rollout_ref.rollout.verify_sync=true", *OVERRIDES])
        assert fit(cfg) == 0
        rows[name] = [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))}
                      for r in read_metrics(str(out))]
    assert rows["toy"] == rows["hf"]
    calls = sys.modules["toy_engine"].CALLS
    # each step generates with the weights of the step before, then takes the new ones, paused around the load
    assert calls == [("generate", 64, 0), ("pause",), ("load_weights", 1, "tensor"), ("resume",),
                     ("generate", 64, 1), ("pause",), ("load_weights", 2, "tensor"), ("resume",)]


def test_unknown_engines_and_transports_are_refused_before_anything_starts(toy):
    with pytest.raises(ConfigError, match=r"rollout.name='tyo' is not a rollout engine \(one of \['hf', 'sglang', "
                                          r"'toy', 'vllm'\]\); did you mean 'toy'\?"):
        preflight(load_config("cpu/tiny_ppo", ["actor_rollout_ref.rollout.name=tyo"]), world_size=1)
    with pytest.raises(ConfigError, match=r"weight_sync: is distributed but the toy engine "
                                          r"\(actor_rollout_ref.rollout.mode=sync\) takes the weights by tensor"):
        preflight(load_config("cpu/tiny_ppo", ["actor_rollout_ref.rollout.name=toy",
                                               "actor_rollout_ref.rollout.weight_sync=distributed"]), world_size=1)
