"""Built-in synthetic verifiable tasks (see `megappo.tasks.synthetic`): a tiny warm-started model, its tokenizer and
train/val prompts written locally, and an exact-match rule reward registered for each task's data_source.

Importing this package does not import torch or pyarrow (reward worker processes import it).
"""
from megappo.tasks.synthetic import (
    TASKS,
    SyntheticTask,
    TaskFiles,
    get_task,
    prepare_task,
    read_task_files,
    synthetic_reward,
)

__all__ = ["TASKS", "SyntheticTask", "TaskFiles", "get_task", "prepare_task", "read_task_files", "synthetic_reward"]
