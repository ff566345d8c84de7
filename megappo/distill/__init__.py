"""On-policy distillation (the `distillation` section): its config rules and teacher specs (`checks`). The run's
teachers (`megappo.trainer.teachers`) and the two phases a step runs with them (`megappo.trainer.distill_phases`)
are the trainer's: they work on its roles, run state and experience."""
