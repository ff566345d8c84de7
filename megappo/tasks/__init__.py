"""Built-in synthetic verifiable tasks (see `megappo.tasks.synthetic`): a tiny warm-started model, its tokenizer and
train/val prompts written locally, and an exact-match rule reward registered for each task's data_source.

Importing this package does not import torch or pyarrow (reward worker processes import it).
"""
from megappo.tasks import colour_square, digit_max_moe, guess_number, tool_sum
from megappo.tasks.synthetic import TASKS as SINGLE_TURN_TASKS
from megappo.tasks.synthetic import (
    SyntheticTask,
    TaskFiles,
    get_task,
    read_task_files,
    synthetic_reward,
)
from megappo.tasks.synthetic import prepare_task as _prepare_single_turn

# every built-in task by name: the single-turn ones, the multi-turn tool task (megappo.tasks.tool_sum), the
# vision-language one (megappo.tasks.colour_square) and the multi-step environment task (megappo.tasks.guess_number)
TASKS = {**SINGLE_TURN_TASKS, **tool_sum.TASKS, **colour_square.TASKS, **guess_number.TASKS, **digit_max_moe.TASKS}


def prepare_task(name: str, out_dir: str, **kwargs) -> TaskFiles:
    """Write built-in task `name`'s model and prompts under `out_dir` (see `megappo.tasks.synthetic.prepare_task`)."""
    if name in tool_sum.TASKS:
        return tool_sum.prepare_task(name, out_dir, **kwargs)
    if name in colour_square.TASKS:
        return colour_square.prepare_task(name, out_dir, **kwargs)
    if name in digit_max_moe.TASKS:  # digit_max on a MoE policy (router replay's recipe)
        return digit_max_moe.prepare_task(name, out_dir, **kwargs)
    if name in guess_number.TASKS:
        return guess_number.prepare_task(name, out_dir, **kwargs)
    return _prepare_single_turn(name, out_dir, **kwargs)

__all__ = ["TASKS", "SyntheticTask", "TaskFiles", "get_task", "prepare_task", "read_task_files", "synthetic_reward"]
