"""`megappo train`: load a recipe plus dotted overrides, validate, then run the PPO trainer.

Registration imports only argparse: torch, megatron and the trainer load when the command runs.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

EPILOG = """\
overrides are dotted key=value pairs, as in verl (values are YAML: true/false, null, 1e-6, [a,b]):
  megappo train --config recipes/gsm8k_tiny_cpu.yaml
  megappo train --config qwen2_5_0_5b_gsm8k actor_rollout_ref.model.path=~/models/Qwen2.5-0.5B-Instruct
  megappo train actor_rollout_ref.actor.use_kl_loss=true algorithm.kl_ctrl.type=adaptive \\
      data.train_files=[~/data/a.parquet,~/data/b.parquet] actor_rollout_ref.actor.optim.lr=1e-6
  megappo train --config recipes/qwen3_8b_gsm8k_tp2.yaml --print-config > run.yaml   # save the resolved tree
  megappo train --config run.yaml --dry-run                                           # check only

options go before the overrides. --config takes a YAML path or the name of a recipe under recipes/.
Every key and default: megappo train --print-config (megappo/config/schema.py documents each one).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="run KL-regularized PPO from a recipe and key=value overrides",
        description="Run PPO (or GRPO) on megatron-core. The configuration is the built-in defaults, then the "
        "recipe given with --config, then the key=value overrides, in that order.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="RECIPE.yaml", help="YAML recipe whose keys override the defaults")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration as YAML and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="load and validate everything (paths included), then exit without training")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. actor_rollout_ref.actor.optim.lr=1e-6")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megappo.config import ConfigError, load_config, to_yaml, validate

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"megappo train: {e}", file=sys.stderr)
        return 1
    if args.print_config:
        sys.stdout.write(to_yaml(cfg))
        sys.stdout.flush()
        try:  # still say what is wrong, but printing needs no model or data on this machine
            validate(cfg, check_files=False)
        except ConfigError as e:
            print(f"megappo train: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        validate(cfg)
    except ConfigError as e:
        print(f"megappo train: {e}", file=sys.stderr)
        return 1
    if args.dry_run:
        t = cfg.trainer
        print(f"megappo train: config OK ({t.nnodes} node(s) x {t.n_gpus_per_node} rank(s), "
              f"model {cfg.actor_rollout_ref.model.path}); --dry-run, not training")
        return 0
    if importlib.util.find_spec("megappo.trainer") is None:
        print("megappo train: the configuration is valid, but the PPO trainer (megappo.trainer) lands in a later "
              "release of megappo; use --print-config or --dry-run until then", file=sys.stderr)
        return 2
    trainer = importlib.import_module("megappo.trainer")
    result = trainer.fit(cfg)
    return result if isinstance(result, int) else 0
