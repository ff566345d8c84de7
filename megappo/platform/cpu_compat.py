"""The adaptation of megatron-core's CUDA assumptions for CPU-only runs (tests, CI; never a GPU).

megatron-core 0.16 assumes a CUDA device in a handful of places. Each item below names the megatron-core code that
needs it (measured in the project notes, shared/notes/megatron-core-on-cpu.md) so that a megatron-core upgrade shows what can go:

1. RNG tracker. `tensor_parallel.random.CudaRNGStatesTracker.add/fork`, `_get_cuda_rng_state`,
   `_set_cuda_rng_state` (used by `model_parallel_cuda_manual_seed`, attention dropout even at p=0, activation
   recompute) read `torch.cuda` generators. Here they use the CPU default generator: tracked states are swapped in
   and out of it exactly as megatron swaps CUDA generator states.
2. `torch.cuda.current_device()` (tensor_parallel.layers, utils.GlobalMemoryBuffer, pipeline p2p_communication,
   gpt_model) and `torch.cuda.synchronize()` (p2p_communication). On a CPU-only torch build both only raise;
   they now return `torch.device("cpu")` and do nothing. Patched only when `torch.cuda.is_available()` is False.
3. Hard-coded `device="cuda"` tensor factories in `pipeline_parallel/schedules.py` (`total_num_tokens`),
   `transformer/utils.py` (the default causal mask, used when no attention mask is passed) and
   `transformer/moe/moe_utils.py` (aux-loss tracker) are redirected by giving those modules a `torch` whose tensor
   factories map a CUDA device to the CPU (module-local, no cost elsewhere).
4. Code that calls tensor methods `.cuda()` / `.type()`: the optimizers (`optimizer/optimizer.py`,
   `distrib_optimizer.py`, `grad_scaler.py`, `clip_grads.py`) allocate on "cuda" and check
   `param.type() == 'torch.cuda.FloatTensor'`; `LanguageModule.setup_embeddings_and_output_layer` (tied embeddings
   with PP) calls `weight.data.cuda()`. Tensor methods cannot be redirected per module, so those specific
   methods/functions are wrapped to run inside `cuda_to_cpu()`, a TorchFunctionMode scoped to the call (it adds a
   Python dispatch to each torch op inside, i.e. only to optimizer steps). `cuda_to_cpu()` is exported for any
   other megatron call found to need it.
5. `transformer/moe/moe_utils.py` references `te_general_gemm` that is only defined when transformer-engine
   imports (0.16.1 bug: NameError in the router without TE); it is defined as None here.
6. `transformer/moe/token_dispatcher.py` (alltoall dispatcher) and `moe_utils.py` create `torch.cuda.Stream()` and
   enter `torch.cuda.stream(...)` for device-to-host copies of split sizes; those modules' `torch.cuda` has a no-op
   stream stand-in (the copies are synchronous on CPU anyway). The same copy (`maybe_move_tensor_to_cpu(...,
   as_numpy=True)`) is what turns the split sizes into the lists `all_to_all_single` needs, but it skips tensors
   that are not on CUDA; the dispatcher's reference to it converts CPU tensors too.

7. Not megatron's but glibc's: its malloc raises the mmap threshold to the size of every large block it frees (up to
   32 MB), after which the trainer's transient buffers (activations, exported buckets) come from the heap and stay
   resident when freed: 11.6 bytes per parameter of a full-parameter PPO run that nothing held
   (tools/bench/bench_memory.py). `fix_malloc_mmap_threshold()` fixes the threshold at 4 MiB (mallopt
   M_MMAP_THRESHOLD, which also turns the raise off), so large blocks are mapped and go back to the system when
   freed. Mapping costs page faults: measured, 4 MiB left 1.3 B/param and added 7% CPU time (user + system) to the
   PPO run, 64 KiB 1.0 B/param and 27%. Linux/glibc only; MALLOC_MMAP_THRESHOLD_ (glibc's own variable, read at process start)
   wins, and MEGAPPO_MALLOC_MMAP_THRESHOLD sets another value in bytes (0: leave glibc's dynamic threshold).
8. `models/common/embeddings/rope_utils.get_pos_emb_on_this_cp_rank` (context parallelism: the rotary positions
   of a CP rank's sequence chunks) builds its index with `pin_memory=True` and `.cuda()`; the rotary embedding
   module's reference to it is replaced by the same selection on the embedding's own device.

`apply_cpu_compat()` is idempotent and refuses to run where CUDA is available, so none of this is ever active on
a GPU. `megappo.platform.detect_platform()` applies it when it chooses the CPU.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import os
import sys
import threading
import types
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False

# ---------------------------------------------------------------------------------------------------------------
# helpers


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)  # a bare index means a CUDA device to torch


def _cpu_kwargs(kwargs: dict) -> dict:
    if "device" in kwargs and _is_cuda_device(kwargs["device"]):
        kwargs = dict(kwargs, device="cpu")
    return kwargs


_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "empty_like", "zeros_like",
    "ones_like", "full_like", "as_tensor",
)


class _CpuStream:
    """Stand-in for torch.cuda.Stream/Event on CPU: work is synchronous, so waiting and recording do nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_CpuStream":
        return _CpuStream()

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _CpuStream()


class _CudaNamespace(types.SimpleNamespace):
    """A module's view of `torch.cuda` with the stream API replaced; everything else is torch.cuda's."""

    Event = _CpuStream

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _CpuStream:  # noqa: N802 - mirrors torch.cuda.Stream
        # One stream: the dispatcher compares it with current_stream() to decide on record_stream() calls.
        return _CURRENT_STREAM

    @staticmethod
    def current_stream(device: Any = None) -> _CpuStream:
        return _CURRENT_STREAM

    @staticmethod
    def stream(s: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


@functools.lru_cache(maxsize=None)
def _cpu_factory(name: str):
    attr = getattr(torch, name)

    @functools.wraps(attr)
    def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
        return attr(*args, **_cpu_kwargs(kwargs))

    return factory


class _TorchNamespace(types.SimpleNamespace):
    """A module's view of `torch` whose tensor factories put device="cuda" tensors on the CPU."""

    cuda = _CudaNamespace()

    def __getattr__(self, name: str) -> Any:
        return _cpu_factory(name) if name in _FACTORIES else getattr(torch, name)


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: A002 - torch's signature
        kwargs = _cpu_kwargs(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str):
            # megatron checks param.type() == 'torch.cuda.FloatTensor' (optimizer.py, distrib_optimizer.py,
            # clip_grads.py): report the CUDA name of the same dtype.
            out = out.replace("torch.", "torch.cuda.", 1) if not out.startswith("torch.cuda.") else out
        return out


_MODE_ACTIVE = threading.local()


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """Run megatron code that uses tensor methods `.cuda()`/`.type()` on CPU (item 4): CUDA allocations go to the
    CPU and `tensor.type()` reports the CUDA type name. A no-op where CUDA is available, and when already inside.
    Scope it tightly: every torch call inside pays a Python-level dispatch."""
    if torch.cuda.is_available() or getattr(_MODE_ACTIVE, "on", False):
        yield
        return
    _MODE_ACTIVE.on = True
    try:
        with _CudaToCpuMode():
            yield
    finally:
        _MODE_ACTIVE.on = False


def _run_in_cuda_to_cpu(fn):
    if getattr(fn, "_megappo_cuda_to_cpu", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with cuda_to_cpu():
            return fn(*args, **kwargs)

    wrapper._megappo_cuda_to_cpu = True
    return wrapper


def _wrap_methods(cls: type) -> None:
    """Wrap `__init__` and the public methods `cls` itself defines (inherited ones are wrapped on their class)."""
    for name, attr in list(vars(cls).items()):
        if inspect.isfunction(attr) and (name == "__init__" or not name.startswith("_")):
            setattr(cls, name, _run_in_cuda_to_cpu(attr))


# ---------------------------------------------------------------------------------------------------------------
# item 1: the model-parallel RNG tracker on the CPU generator


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _make_cpu_tracker_class(base: type) -> type:
    class CpuRNGStatesTracker(base):  # type: ignore[valid-type, misc]
        """megatron's CudaRNGStatesTracker with its states held for the CPU default generator."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            # megatron's fork also warns when the CPU state changes inside; on CPU that *is* the tracked state.
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _cpu_get_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_rng_state
    # initialize_rng_tracker() instantiates the module-global CudaRNGStatesTracker; get_all_rng_states() uses
    # isinstance against it, which a subclass keeps true.
    if not getattr(mrandom.CudaRNGStatesTracker, "_megappo_cpu", False):
        cls = _make_cpu_tracker_class(mrandom.CudaRNGStatesTracker)
        cls._megappo_cpu = True
        mrandom.CudaRNGStatesTracker = cls
    mrandom.initialize_rng_tracker(force_reset=True)


# ---------------------------------------------------------------------------------------------------------------
# item 2: torch.cuda.current_device / synchronize on a CPU-only build


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _noop_synchronize(device: Any = None) -> None:
    return None


def _patch_cuda_device_queries() -> None:
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _noop_synchronize


# ---------------------------------------------------------------------------------------------------------------
# items 3, 5, 6: module-local redirections


def _patch_modules() -> None:
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for module in (schedules, transformer_utils, moe_utils, token_dispatcher):  # items 3 and 6
        module.torch = _TorchNamespace()
    original_move = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu  # item 6
    if not hasattr(moe_utils, "te_general_gemm"):  # item 5
        moe_utils.te_general_gemm = None
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank  # item 8


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """megatron's `get_pos_emb_on_this_cp_rank` (chunks r and 2cp-1-r of 2cp along `seq_dim`) on any device."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _patch_tensor_method_users() -> None:  # item 4
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler
    from megatron.core.optimizer import optimizer as moptimizer

    for cls in (
        moptimizer.MegatronOptimizer, moptimizer.MixedPrecisionOptimizer,
        moptimizer.Float16OptimizerWithFloat16Params, moptimizer.FP32Optimizer, moptimizer.ChainedOptimizer,
        distrib_optimizer.DistributedOptimizer,
        grad_scaler.MegatronGradScaler, grad_scaler.ConstantGradScaler, grad_scaler.DynamicGradScaler,
    ):
        _wrap_methods(cls)
    for name in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32"):
        setattr(clip_grads, name, _run_in_cuda_to_cpu(getattr(clip_grads, name)))
    LanguageModule.setup_embeddings_and_output_layer = _run_in_cuda_to_cpu(
        LanguageModule.setup_embeddings_and_output_layer
    )


# glibc's mallopt parameter number (malloc.h). 4 MiB: blocks above it are mapped, those below come from the heap
# (item 7: the trade between what fragmentation strands and the page faults of mapping)
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 4 << 20
_MMAP_ENV = "MEGAPPO_MALLOC_MMAP_THRESHOLD"


def fix_malloc_mmap_threshold() -> int:
    """Item 7: fix glibc's mmap threshold for the rest of the process; returns the threshold set (0: none set, on a
    non-glibc C library, or where MALLOC_MMAP_THRESHOLD_ or MEGAPPO_MALLOC_MMAP_THRESHOLD=0 says otherwise)."""
    raw = os.environ.get(_MMAP_ENV, str(_MMAP_THRESHOLD_BYTES))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{_MMAP_ENV}={raw!r}: give the threshold in bytes (0: leave glibc's own)") from None
    if not 0 <= value <= 32 << 20:  # glibc refuses more than HEAP_MAX/2 (32 MiB on 64-bit)
        raise ValueError(f"{_MMAP_ENV}={value}: give 0 (glibc's own threshold) or 1..{32 << 20} bytes")
    if value == 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ or not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: their malloc has no such threshold
        return 0
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return value if mallopt(_M_MMAP_THRESHOLD, value) == 1 else 0


def apply_cpu_compat() -> bool:
    """Adapt megatron-core to a CPU-only process (items 1-6 and 8 above) and glibc's malloc (item 7). Idempotent;
    returns True once applied.

    Raises RuntimeError where CUDA is available: the adaptation must never be active on a GPU.
    """
    global _APPLIED
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_compat() is for CPU-only processes; CUDA is available here")
    if _APPLIED:
        return True
    _patch_cuda_device_queries()
    _patch_rng_tracker()
    _patch_modules()
    _patch_tensor_method_users()
    fix_malloc_mmap_threshold()
    _APPLIED = True
    return True


def cpu_compat_applied() -> bool:
    return _APPLIED
