"""`megappo train`: load a recipe plus dotted overrides, validate, then run the PPO trainer.

Registration imports only argparse: torch, megatron and the trainer load when the command runs.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

EPILOG = """\
overrides are dotted key=value pairs, as in verl (values are YAML: true/false, null, 1e-6, [a,b]):
  megappo train --config recipes/gsm8k/tiny_cpu.yaml
  megappo train --config gsm8k/qwen2.5-0.5b_ppo actor_rollout_ref.model.path=~/models/Qwen2.5-0.5B-Instruct
  megappo train actor_rollout_ref.actor.use_kl_loss=true algorithm.kl_ctrl.type=adaptive \\
      data.train_files=[~/data/a.parquet,~/data/b.parquet] actor_rollout_ref.actor.optim.lr=1e-6
  megappo train --config gsm8k/qwen3-8b_ppo_tp2 --print-config > run.yaml   # check, save the resolved tree
  megappo train --config run.yaml --dry-run                                 # check files too, do not train

options go before the overrides. --config takes a YAML path or the name of a recipe under recipes/
(e.g. gsm8k/tiny_cpu for recipes/gsm8k/tiny_cpu.yaml).
Every key and default: megappo/config/schema/ documents each one; --print-config shows a resolved tree.

exit status (also in <default_local_dir>/run_status.json, which outlives torchrun's own status):
  0   finished
  1   error (configuration, data, your own code that does not load or has the wrong signature: an agent,
      environment, judge parser, reward function or tool; a failed checkpoint save: the message names the fix)
  3   stopped on purpose: the KL guard ran out of retries, the reward function, a tool, the agents or the
      environments keep failing, or a step of dynamic sampling reached algorithm.filter_groups.max_num_gen_batches
  75  preempted by SIGTERM/SIGUSR1 or trainer.save_before_deadline: a checkpoint was saved; run the same
      command again (resume_mode=auto) to continue. Batch scripts requeue on it.
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
                        help="check the configuration (not its files) and, when it is valid, print it resolved as "
                        "YAML and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="check everything (model, data schema, reward function included), then exit without "
                        "training")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an input error (config, data, your agent, environment, judge parser, "
                        "reward function or tool, checkpoint) too; "
                        "without it the message alone is printed and the traceback goes to "
                        "<default_local_dir>/error.log")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. actor_rollout_ref.actor.optim.lr=1e-6")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megappo.trainer import user_errors

    if "LOCAL_RANK" in os.environ and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # a torchrun rank inherits launch/torchrun.sh's torchrun's ignored SIGINT: the Ctrl-C the script passes on
        # must reach it (the trainer installs its own handler once set up)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    loaded: list = []  # the config once loaded: its output directory takes the error log
    try:
        return _run(args, loaded)
    except KeyboardInterrupt:  # Ctrl-C before the trainer's own handler is installed, or after it is removed
        if int(os.environ.get("RANK", "0")) == 0:
            print("megappo train: interrupted (Ctrl-C) while starting or shutting down, outside any step; the "
                  "checkpoints already written stay", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception as e:
        if not user_errors.is_user_error(e):
            raise
        return user_errors.report(e, loaded[0].trainer.default_local_dir if loaded else None, debug=args.debug)


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended


def _run(args: argparse.Namespace, loaded: list) -> int:
    from megappo.config import load_config, to_yaml
    from megappo.trainer.preflight import preflight

    cfg = load_config(args.config, args.overrides)
    loaded.append(cfg)
    launched = not (args.print_config or args.dry_run)
    # first the launch against the config: the checks below plan for the config's world size
    mismatch = launched and launch_mismatch(cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, os.environ)
    if mismatch:
        if int(os.environ.get("RANK", "0")) == 0:  # every rank finds it; one says it
            print(f"megappo train: {mismatch}", file=sys.stderr)
        return 1
    # --print-config needs no model or data on this machine; its output is only ever a valid configuration
    preflight(cfg, check_files=False if args.print_config else None)
    if args.print_config:
        sys.stdout.write(to_yaml(cfg))
        sys.stdout.flush()
        return 0
    if args.dry_run:
        from megappo.trainer.dry_run import check_inputs

        check_inputs(cfg)
        t = cfg.trainer
        model = (f"synthetic task {cfg.data.synthetic.name}" if cfg.data.synthetic.name is not None
                 else f"model {cfg.actor_rollout_ref.model.path}")
        print(f"megappo train: config OK ({t.nnodes} node(s) x {t.n_gpus_per_node} rank(s), {model}); "
              "--dry-run, not training")
        return 0
    from megappo import trainer
    from megappo.platform.child_reaper import die_with_launcher
    from megappo.platform.exits import EXIT_STOPPED, RunStopped

    die_with_launcher()  # under torchrun: a rank outlives no launcher (torchrun puts each rank in its own session)

    try:
        result = trainer.fit(cfg)
    except RunStopped as e:  # the KL guard, the reward watch or dynamic sampling ended the run on purpose
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"megappo train: {e}", file=sys.stderr)
        return EXIT_STOPPED
    return result if isinstance(result, int) else 0


def launch_mismatch(nnodes: int, per_node: int, environ) -> str | None:
    """Why the ranks torchrun started (WORLD_SIZE, LOCAL_WORLD_SIZE in `environ`) do not fit the config's
    trainer.nnodes x trainer.n_gpus_per_node, naming the fix; None when they fit.

    Under torchrun the launch is taken as meant (the user typed --nnodes and --nproc-per-node): the message gives
    the keys' values that match it. Without torchrun (one process) it says how to launch the config's ranks."""
    def ranks(n: int) -> str:
        return f"{n} rank" if n == 1 else f"{n} ranks"

    expected = nnodes * per_node
    asked = (f"the config asks for {ranks(expected)} (trainer.nnodes={nnodes} x "
             f"trainer.n_gpus_per_node={per_node})")
    world = int(environ.get("WORLD_SIZE") or 1)
    if world == expected:
        return None
    if "WORLD_SIZE" not in environ:
        return (f"{asked} but 1 were started (one process, no torchrun); launch with `torchrun --nproc-per-node "
                f"{per_node} --nnodes {nnodes} -m megappo.cli train ...` on each node (launch/torchrun.sh does it), "
                "or set trainer.nnodes=1 trainer.n_gpus_per_node=1")
    local = int(environ.get("LOCAL_WORLD_SIZE") or world)
    if local < 1 or world % local:  # nodes with different rank counts: no pair of keys describes it
        return (f"{asked} but torchrun started {ranks(world)}, not the same number on every node; launch "
                f"`torchrun --nproc-per-node {per_node}` on each of {nnodes} node(s)")
    nodes = world // local
    fix = " ".join(f"{k}={v}" for k, v, mine in (("trainer.nnodes", nodes, nnodes),
                                                ("trainer.n_gpus_per_node", local, per_node)) if v != mine)
    return (f"{asked} but torchrun started {ranks(world)} ({nodes} node(s) x {local} per node); to train on the "
            f"ranks as launched, add {fix} to the command (or launch `torchrun --nproc-per-node {per_node}` on "
            f"each of {nnodes} node(s))")
