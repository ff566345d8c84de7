"""Which function scores a sample: the built-in registry keyed by `data_source`, or a user's function from a file.

Every reward function has verl's signature

    fn(data_source: str, solution_str: str, ground_truth, extra_info: dict | None) -> float | dict

where a dict holds the reward under "score" and any other numeric entries become logged metrics.

Functions travel to worker processes by reference: registry entries are module-level functions, and a user's
function is wrapped in `CustomRewardFn`, which pickles as (path, name) and re-imports the file in the worker.
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Callable, Optional

from megappo.platform.user_code import UserCodeError

RewardFn = Callable[[str, str, Any, "dict | None"], "float | dict"]

_REGISTRY: dict[str, RewardFn] = {}
# (prefix, fn): a data_source that starts with the prefix and has no exact entry (verl scores every "aime*" source
# with its math_dapo rule: "aime2024", "aime_2025", ...)
_PREFIXES: list[tuple[str, RewardFn]] = []


class RewardFunctionError(UserCodeError):
    """A reward function could not be found or loaded; the message names the fix."""


def register_reward(*data_sources: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: score samples whose `data_source` is one of `data_sources` with the decorated function.

    >>> @register_reward("my/dataset")
    ... def my_score(data_source, solution_str, ground_truth, extra_info=None): ...
    """
    if not data_sources:
        raise ValueError("register_reward needs at least one data_source")

    def wrap(fn: RewardFn) -> RewardFn:
        for source in data_sources:
            existing = _REGISTRY.get(source)
            if existing is not None and existing is not fn:
                raise ValueError(
                    f"data_source {source!r} already has reward function {existing.__module__}."
                    f"{existing.__qualname__}; register a different data_source or pass a custom reward function"
                )
            _REGISTRY[source] = fn
        return fn

    return wrap


# Built-in rewards that live with their tasks: (module, function returning {data_source: reward function}). They
# are registered on the first look-up that misses (and on every listing), never at import time: a process that
# imports the registry imports a task only when it scores one. The GSM8K reward (below) is registered here and
# imports its scoring module when first called.
_BUILTINS = (("megappo.tasks.synthetic", "builtin_rewards"), ("megappo.tasks.tool_sum", "builtin_rewards"),
             ("megappo.tasks.colour_square", "builtin_rewards"), ("megappo.tasks.guess_number", "builtin_rewards"))


def _load_builtins() -> None:
    for module, attr in _BUILTINS:
        for source, fn in getattr(importlib.import_module(module), attr)().items():
            _REGISTRY.setdefault(source, fn)


def registered_data_sources() -> list[str]:
    """Every registered data_source; a prefix entry is listed as "prefix*"."""
    _load_builtins()
    return sorted([*_REGISTRY, *(f"{prefix}*" for prefix, _ in _PREFIXES)])


def _by_prefix(data_source: str) -> Optional[RewardFn]:
    for prefix, fn in _PREFIXES:
        if data_source.startswith(prefix):
            return fn
    return None


def get_reward_fn(data_source: str) -> RewardFn:
    """The registered reward function for `data_source`; a KeyError-like error listing the known ones otherwise."""
    if data_source not in _REGISTRY:
        _load_builtins()
    fn = _REGISTRY.get(data_source) or _by_prefix(data_source)
    if fn is None:
        raise RewardFunctionError(
            f"no reward function is registered for data_source {data_source!r} (known: "
            f"{', '.join(registered_data_sources()) or 'none'}); set custom_reward_function.path/.name to a file "
            "defining fn(data_source, solution_str, ground_truth, extra_info), or register one with "
            "megappo.rewards.register_reward"
        )
    return fn


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float | dict:
    """Dispatch to the registered function of `data_source` (the scorer's function when none is configured)."""
    return get_reward_fn(data_source)(data_source, solution_str, ground_truth, extra_info)


# ---------------------------------------------------------------------------------------------------------------
# built-in rule rewards
# ---------------------------------------------------------------------------------------------------------------
@register_reward("openai/gsm8k", "gsm8k")
def gsm8k_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    from megappo.rewards import gsm8k

    return gsm8k.compute_score(solution_str, ground_truth)


# verl's default_compute_score sends these sources, and every one starting with "aime", to math_dapo
MATH_DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
MATH_DAPO_PREFIX = "aime"


@register_reward(*MATH_DAPO_SOURCES)
def math_dapo_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    from megappo.rewards import math_dapo

    return math_dapo.compute_score(solution_str, ground_truth)


_PREFIXES.append((MATH_DAPO_PREFIX, math_dapo_reward))


@register_reward("hiyouga/geometry3k")
def geo3k_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    from megappo.rewards import geo3k

    return geo3k.compute_score(solution_str, ground_truth)


# ---------------------------------------------------------------------------------------------------------------
# user functions from a file
# ---------------------------------------------------------------------------------------------------------------
def _import_file(path: str):
    from megappo.platform.user_code import NotPython, import_file

    try:
        return import_file(path, "megappo_custom_reward")
    except NotPython as e:
        raise RewardFunctionError(f"custom_reward_function.path {path!r} cannot be imported as Python; point it at a "
                                  ".py file") from e
    except Exception as e:
        raise RewardFunctionError(
            f"importing custom_reward_function.path {path!r} failed with {type(e).__name__}: {e}; fix the file "
            f"(run `python {path}` to see the full traceback)"
        ) from e


class CustomRewardFn:
    """A reward function defined in a user's file, loaded on first call; pickles as (path, name) so worker
    processes (multiprocessing or Ray, possibly on other nodes sharing the path) import it themselves."""

    def __init__(self, path: str, name: str = "compute_score"):
        self.path = os.path.abspath(os.path.expanduser(path))
        self.name = name
        self._fn: Callable | None = None

    def load(self) -> Callable:
        if self._fn is None:
            if not os.path.isfile(self.path):
                raise RewardFunctionError(
                    f"custom_reward_function.path {self.path!r} does not exist; set it to the Python file that "
                    f"defines {self.name}()"
                )
            module = _import_file(self.path)
            if not hasattr(module, self.name):
                callables = sorted(
                    k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                    and getattr(v, "__module__", None) == module.__name__
                )
                raise RewardFunctionError(
                    f"{self.path} defines no {self.name!r}; set custom_reward_function.name to one of its "
                    f"functions: {', '.join(callables) or '(none defined)'}"
                )
            fn = getattr(module, self.name)
            if not callable(fn):
                raise RewardFunctionError(
                    f"{self.path}: {self.name!r} is a {type(fn).__name__}, not a function; set "
                    "custom_reward_function.name to a function fn(data_source, solution_str, ground_truth, "
                    "extra_info)"
                )
            self._fn = fn
        return self._fn

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None):
        return self.load()(data_source, solution_str, ground_truth, extra_info)

    def __getstate__(self) -> dict:
        return {"path": self.path, "name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.path, self.name, self._fn = state["path"], state["name"], None

    def __repr__(self) -> str:
        return f"CustomRewardFn({self.path!r}, {self.name!r})"


def load_custom_reward_fn(path: str | None, name: str = "compute_score") -> CustomRewardFn | None:
    """The user's reward function `name` from the Python file `path` (None when `path` is None: use the registry).

    Loads it once here so a wrong path or name fails before training starts rather than in a worker.
    """
    if path is None:
        return None
    fn = CustomRewardFn(path, name)
    fn.load()
    return fn
