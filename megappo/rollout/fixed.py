"""Engines that serve a fixed model beside the policy's: a distillation teacher's log-probs, a generative judge's
verdicts. Each is a deployment of a registered engine (`megappo.rollout.registry`) with the policy rollout's
settings and its own model, servers and knobs (`InferenceConfig`): a fleet of its own, started and stopped with the
run, whose weights no weight sync touches (the trainer never calls `load_weights` on it).

Deploy one with the registry, `registry.deploy(fixed_settings(...), ps, platform)`: collective, like every
deployment (every rank calls it; each data-parallel replica's first rank holds an engine, `deployment.engine`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from megappo.rollout.settings import RolloutSettings


def fixed_settings(policy: RolloutSettings, model_path: str, inference: Any) -> RolloutSettings:
    """The policy rollout's settings with `inference` (an `InferenceConfig`) over them, serving `model_path`."""
    inf = inference
    return replace(
        policy, name=inf.name or policy.name, model_path=model_path, server_urls=tuple(inf.server_urls),
        servers_per_node=inf.servers_per_node if inf.servers_per_node is not None else policy.servers_per_node,
        tensor_model_parallel_size=inf.tensor_model_parallel_size or policy.tensor_model_parallel_size,
        max_num_seqs=inf.max_num_seqs or policy.max_num_seqs,
        engine_kwargs=dict(inf.engine_kwargs) if inf.name and inf.name != policy.name else
        {**policy.engine_kwargs, **inf.engine_kwargs},
        hybrid_engine=policy.hybrid_engine if inf.hybrid_engine is None else inf.hybrid_engine,
        lora_adapter=None)
