"""The configuration a run directory was trained with: `<default_local_dir>/config.yaml`, the resolved tree of the
last start that trained there. A start with a different configuration is said on the console: over a finished run
(which then does nothing, and the new configuration would never run) and when resuming one (the checkpoint was
trained under the old one).

Keys that only say how long the run goes, where its output is, when it saves, validates or logs, how long it waits
for the directory, or on how many ranks in which parallel layout it runs are not differences: extending
total_training_steps, saving more often, or a requeue on another number of nodes is the same run continued.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

import yaml

from megappo.trainer.files import write_atomic

CONFIG_FILE = "config.yaml"
# dotted keys (and whole subtrees) that do not change what the run computes
NOT_THE_RUN = (
    "trainer.total_training_steps", "trainer.total_epochs", "trainer.default_local_dir", "trainer.resume_mode",
    "trainer.resume_from_path", "trainer.save_freq", "trainer.max_ckpt_to_keep", "trainer.test_freq",
    "trainer.val_before_train", "trainer.log_val_generations", "trainer.logger", "trainer.project_name",
    "trainer.experiment_name", "trainer.dir_lock_wait_s", "trainer.save_before_deadline",
    # the ranks and their parallel layout: a checkpoint loads at any layout, and the numbers do not depend on it
    "trainer.nnodes", "trainer.n_gpus_per_node",
)
SHOWN = 8  # differences listed; the rest are counted


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _counts(key: str) -> bool:
    from megappo.config.derived import LAYOUT_KEYS

    if ".megatron." in key and key.rsplit(".", 1)[1] in LAYOUT_KEYS:
        return False
    return not any(key == k or key.startswith(k + ".") for k in NOT_THE_RUN)


def differences(old: dict, new: dict) -> list[str]:
    """'key: old -> new' for every leaf that differs and changes the run."""
    a, b = _flatten(old), _flatten(new)

    def value(tree: dict, key: str) -> str:
        return repr(tree[key]) if key in tree else "(absent)"

    return [f"{k}: {value(a, k)} -> {value(b, k)}" for k in sorted(set(a) | set(b))
            if _counts(k) and (k not in a or k not in b or a[k] != b[k])]


def snapshot(cfg) -> str:
    """The resolved configuration as stored (before the run fills in paths of its own, such as a synthetic task's)."""
    from megappo.config import to_yaml

    return to_yaml(cfg)


def changes(local_dir: str, text: str) -> Optional[list[str]]:
    """How `text` (a snapshot) differs from the configuration stored in `local_dir`; None when none is stored."""
    try:
        with open(os.path.join(local_dir, CONFIG_FILE)) as f:
            stored = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(stored, dict):
        return None
    return differences(stored, yaml.safe_load(text))


def describe(diffs: list[str]) -> str:
    shown = "; ".join(diffs[:SHOWN])
    return shown + (f"; and {len(diffs) - SHOWN} more" if len(diffs) > SHOWN else "")


def warn_finished(local_dir: str, text: str) -> None:
    """Over a finished run: say so loudly when this configuration is not the one that finished there."""
    diffs = changes(local_dir, text)
    if diffs:
        print(f"megappo train: WARNING: this configuration is not the one that finished in {local_dir} "
              f"({describe(diffs)}), and it was not trained. To train it, set trainer.default_local_dir to a "
              "directory of its own (or trainer.resume_mode=disable to train it here from the start)",
              file=sys.stderr, flush=True)


def record(local_dir: str, text: str, resumed: bool) -> None:
    """Store this start's configuration; when resuming under a different one, say which keys changed."""
    diffs = changes(local_dir, text) if resumed else None
    if diffs:
        print(f"megappo train: WARNING: resuming {local_dir} under a different configuration than it was trained "
              f"with ({describe(diffs)})", file=sys.stderr, flush=True)
    write_atomic(os.path.join(local_dir, CONFIG_FILE), text)
