"""On-policy distillation (the `distillation` section): teachers that score the student's tokens, chosen once at
setup (`teachers.build_teachers`), and the two phases a step runs with them (`phases`)."""
