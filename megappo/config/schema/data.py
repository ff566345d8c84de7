"""The configuration tree's `data` section: the Parquet prompt sets, their lengths and batch sizes, and the
built-in synthetic tasks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union


@dataclass
class SyntheticTaskConfig:
    """A built-in verifiable task that needs no files: before anything else the trainer writes a tiny model (with a
    short supervised warm start) and its train/val prompt sets under `<trainer.default_local_dir>/synthetic/`, and
    points actor_rollout_ref.model.path, data.train_files and data.val_files at them. Deterministic in `seed`."""

    name: Optional[str] = None  # None: off; a task of megappo.tasks (e.g. the main CPU job's)
    num_train_prompts: int = 1024
    num_val_prompts: int = 64
    warm_start_steps: int = 200  # supervised steps on the task before RL (~8 s on 2 cores; 0: the random model)
    seed: int = 0
    # a distillation teacher for the task (megappo/tasks/teacher.py: a larger Llama with the task's tokenizer,
    # ~16 s), warm-started with this target smoothing (the student's: 0.85); distillation.teacher_model.model_path
    # null takes it. None: no teacher
    teacher_smoothing: Optional[float] = None
    teacher_warm_start_steps: int = 300


@dataclass
class DataConfig:
    tokenizer: Optional[str] = None  # None: the actor model's tokenizer
    train_files: Union[str, list[str]] = "~/data/gsm8k/train.parquet"  # one Parquet path or a list
    val_files: Union[str, list[str], None] = "~/data/gsm8k/test.parquet"  # None: no validation
    prompt_key: str = "prompt"  # column holding the chat messages
    reward_fn_key: str = "data_source"  # column that picks the reward function
    max_prompt_length: int = 512  # prompt tokens after the chat template
    max_response_length: int = 512  # generated tokens per response
    train_batch_size: int = 1024  # prompts per PPO step
    # prompts generated at a time; resolved: train_batch_size. Larger (DAPO: 3x) with algorithm.filter_groups, so
    # that one generation batch usually leaves train_batch_size prompts after the filter
    gen_batch_size: Optional[int] = None
    val_batch_size: Optional[int] = None  # None: the whole validation set at once
    return_raw_chat: bool = False  # keep the untokenised messages (for an RM with another chat template)
    truncation: Literal["error", "left", "right"] = "error"  # what to do with a prompt over max_prompt_length
    filter_overlong_prompts: bool = False  # drop prompts over max_prompt_length when the dataset loads
    shuffle: bool = True  # shuffle training prompts each epoch
    seed: int = 1  # seed of that shuffle, so a resumed run sees the same order
    # Multimodal prompts (a vision-language actor; megappo.data.multimodal): the column of images, and the bounds
    # of Qwen's smart_resize in pixels (each image's area is brought into [min, max], sides multiples of 28). The
    # defaults are the released Qwen2-VL / Qwen2.5-VL processors' (56*56, 28*28*1280).
    image_key: str = "images"
    image_min_pixels: int = 3136
    image_max_pixels: int = 1003520
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
