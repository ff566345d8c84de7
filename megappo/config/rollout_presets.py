"""verl 0.9.1's named rollout-correction presets (``RolloutCorrectionConfig.<name>()``), as plain data.

``algorithm.rollout_correction.preset=NAME`` starts the section from the preset's seven fields (every field, as
verl's factory builds the whole config); keys the user sets in the same section (recipe or command line) override
them. Names: ``decoupled_*`` recompute the old policy and weight / reject against it (three policies);
``bypass_*`` take the rollout's log-probs as old (two policies), ``ppo_clip`` or ``pg`` (REINFORCE, ``loss_type
=reinforce``). ``is`` / ``token_is`` / ``seq_is``: truncated IS at 2.0 per token or per sequence; ``icepop``: token
weights outside [0.5, 5] zeroed; ``geo_rs``: reject rows whose geometric-mean ratio leaves [0.999, 1.001]
(``seq_mean_k1``); ``k3_rs``: reject rows whose mean k3 divergence passes 0.01; ``seq_is_rs``: reject rows whose
sequence ratio leaves [0.5, 2] (``seq_sum_k1``); ``disabled``: metrics only.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from megappo.config.schema import RolloutCorrectionConfig

__all__ = ["PRESETS"]

_GEO_RS = dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001")
_K3_RS = dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01)
_TOKEN_IS = dict(rollout_is="token", rollout_is_threshold=2.0)
_SEQ_IS = dict(rollout_is="sequence", rollout_is_threshold=2.0)
_ICEPOP = dict(rollout_is="token", rollout_is_threshold="0.5_5.0")
_BYPASS_PPO = dict(bypass_mode=True, loss_type="ppo_clip")
_BYPASS_PG = dict(bypass_mode=True, loss_type="reinforce")


def _preset(*parts: dict[str, Any]) -> dict[str, Any]:
    """The whole section: the schema's defaults (verl's dataclass defaults; every preset names its rollout_is), then
    the parts."""
    out = asdict(RolloutCorrectionConfig())
    del out["preset"]
    for part in parts:
        out.update(part)
    return out


PRESETS: dict[str, dict[str, Any]] = {
    "decoupled_token_is": _preset(_TOKEN_IS),
    "decoupled_seq_is": _preset(_SEQ_IS),
    "decoupled_token_icepop": _preset(_ICEPOP),
    "decoupled_seq_is_rs": _preset(_SEQ_IS, dict(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0")),
    "decoupled_geo_rs": _preset(_GEO_RS),
    "decoupled_geo_rs_seq_tis": _preset(_SEQ_IS, _GEO_RS),
    "decoupled_geo_rs_token_tis": _preset(_TOKEN_IS, _GEO_RS),
    "decoupled_k3_rs": _preset(_K3_RS),
    "decoupled_k3_rs_seq_tis": _preset(_SEQ_IS, _K3_RS),
    "decoupled_k3_rs_token_tis": _preset(_TOKEN_IS, _K3_RS),
    "bypass_ppo_clip": _preset(_BYPASS_PPO),
    "bypass_ppo_clip_geo_rs": _preset(_GEO_RS, _BYPASS_PPO),
    "bypass_ppo_clip_k3_rs": _preset(_K3_RS, _BYPASS_PPO),
    "bypass_pg_is": _preset(_SEQ_IS, _BYPASS_PG),
    "bypass_pg_token_icepop": _preset(_ICEPOP, _BYPASS_PG),
    "bypass_pg_geo_rs": _preset(_GEO_RS, _BYPASS_PG),
    "bypass_pg_geo_rs_seq_tis": _preset(_SEQ_IS, _GEO_RS, _BYPASS_PG),
    "bypass_pg_geo_rs_token_tis": _preset(_TOKEN_IS, _GEO_RS, _BYPASS_PG),
    "disabled": _preset(),
}
