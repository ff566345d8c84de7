"""The one place parallelism is set up: torch.distributed, megatron's model-parallel groups and seeds.

`init_parallel(layout, platform, seed)` validates the layout, joins the default process group (from torchrun/Ray
env vars) when needed, builds megatron's TP/PP/VPP/CP/EP/ETP groups and returns a `ParallelState` holding the
groups and this rank's coordinates. Code that communicates receives these groups as arguments rather than
reading megatron's globals.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from megappo.platform.device import Platform, seed_everything
from megappo.platform.layout import ParallelLayout, check_layout

ProcessGroup = Any  # torch.distributed.ProcessGroup (an alias keeps the dataclass readable)


@dataclass
class ParallelState:
    """This rank's process groups, ranks and sizes. Pass it (or its groups) to code that communicates."""

    layout: ParallelLayout
    world_size: int
    rank: int
    tp_group: ProcessGroup
    pp_group: ProcessGroup
    cp_group: ProcessGroup
    dp_group: ProcessGroup  # data parallel, without context parallel
    dp_cp_group: ProcessGroup  # data x context parallel: gradients are reduced over this group
    mp_group: ProcessGroup  # tensor x pipeline model parallel
    tp_cp_group: ProcessGroup
    embedding_group: Optional[ProcessGroup]  # first and last pipeline stage (tied embeddings); None off those
    ep_group: ProcessGroup  # expert model parallel
    expert_tp_group: ProcessGroup  # expert tensor parallel
    expert_dp_group: ProcessGroup  # data parallel for expert weights
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    cp_size: int
    dp_rank: int
    dp_size: int
    ep_rank: int
    ep_size: int
    etp_rank: int
    etp_size: int
    vpp_size: Optional[int]
    pg_collection: Any  # megatron.core.process_groups_config.ProcessGroupCollection, passed to GPTModel

    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size} pp {self.pp_rank}/{self.pp_size}"
            f" cp {self.cp_rank}/{self.cp_size} dp {self.dp_rank}/{self.dp_size} ep {self.ep_rank}/{self.ep_size}"
            f" etp {self.etp_rank}/{self.etp_size} vpp {self.vpp_size}"
        )


def _init_default_group(platform: Platform) -> None:
    """Join the default process group from torchrun/Ray env vars (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    kwargs: dict[str, Any] = dict(backend=platform.backend, timeout=timedelta(minutes=30))
    if missing:
        if os.environ.get("WORLD_SIZE", "1") != "1":
            raise RuntimeError(f"torch.distributed env vars {missing} are not set; launch with torchrun")
        # A single process run without a launcher: a world of one on an in-process store. No port is opened, so
        # nothing can collide with it, and no MASTER_PORT leaks into the environment of processes started later.
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
        os.environ.setdefault("LOCAL_RANK", "0")
    if platform.is_cuda:
        kwargs["device_id"] = platform.device
    dist.init_process_group(**kwargs)


def init_parallel(
    layout: ParallelLayout,
    platform: Platform,
    seed: int = 0,
    *,
    num_attention_heads: Optional[int] = None,
    num_key_value_heads: Optional[int] = None,
    num_layers: Optional[int] = None,
    num_experts: Optional[int] = None,
) -> ParallelState:
    """Validate `layout`, create every process group and seed every RNG; return this rank's `ParallelState`.

    The model dimensions are optional: given, `check_layout` also checks heads/layers/experts divisibility before
    any group is created. A world size mismatch fails here before any collective.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    check_layout(
        layout, world_size, num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        num_layers=num_layers, num_experts=num_experts,
    )
    if platform.is_cuda:
        torch.cuda.set_device(platform.device)
    _init_default_group(platform)

    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    vpp = layout.vpp if layout.vpp and layout.vpp > 1 else None
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp or layout.tp,
    )
    seed_everything(seed)
    state = ParallelState(
        layout=layout,
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp_group=mpu.get_tensor_model_parallel_group(),
        pp_group=mpu.get_pipeline_model_parallel_group(),
        cp_group=mpu.get_context_parallel_group(),
        dp_group=mpu.get_data_parallel_group(),
        dp_cp_group=mpu.get_data_parallel_group(with_context_parallel=True),
        mp_group=mpu.get_model_parallel_group(),
        tp_cp_group=mpu.get_tensor_and_context_parallel_group(),
        embedding_group=mpu.get_embedding_group(check_initialized=False),
        ep_group=mpu.get_expert_model_parallel_group(),
        expert_tp_group=mpu.get_expert_tensor_parallel_group(),
        expert_dp_group=mpu.get_expert_data_parallel_group(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        tp_size=mpu.get_tensor_model_parallel_world_size(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        pp_size=mpu.get_pipeline_model_parallel_world_size(),
        cp_rank=mpu.get_context_parallel_rank(),
        cp_size=mpu.get_context_parallel_world_size(),
        dp_rank=mpu.get_data_parallel_rank(),
        dp_size=mpu.get_data_parallel_world_size(),
        ep_rank=mpu.get_expert_model_parallel_rank(),
        ep_size=mpu.get_expert_model_parallel_world_size(),
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
        etp_size=mpu.get_expert_tensor_parallel_world_size(),
        vpp_size=vpp,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    return state


def destroy_parallel(destroy_process_group: bool = False) -> None:
    """Tear down megatron's model-parallel groups (and the default group when asked)."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()


def union_over_ranks(names: set[str], group: Any = None) -> set[str]:
    """The union of every rank's `names` over `group` (default: the world); `names` itself without peers."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return set(names)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, sorted(names), group=group)
    return set().union(*map(set, gathered))


def collective_device(group: Any = None) -> torch.device:
    """Where a tensor must be for a collective on `group`: the current GPU for NCCL (which takes no CPU tensors), else
    the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_tensor(t: torch.Tensor, op: Any = None, group: Any = None) -> torch.Tensor:
    """A reduced copy of `t` over `group` (default: the world; `op` default SUM), on `t`'s device; `t` itself without
    peers. Moves it to where the backend needs it (NCCL: the GPU) and back."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    out = t.to(collective_device(group), copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return out.to(t.device)


def reduce_over_ranks(values: list[float], op: Any = None, group: Any = None,
                      dtype: torch.dtype = torch.float64) -> list[float]:
    """`values` reduced elementwise over `group` (default: the world; `op` default SUM): the same list on every
    rank. Collective when there are peers."""
    return reduce_tensor(torch.tensor(values, dtype=dtype), op, group).tolist()


def gather_over_ranks(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """`t` of every rank of `group`, concatenated along dim 0 in rank order (every rank's `t` has the same shape)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    src = t.to(collective_device(group)).contiguous()
    parts = [torch.empty_like(src) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, src, group=group)
    return torch.cat(parts).to(t.device)


def leave_run(message: str, code: int = 1) -> None:
    """Print `message` as this rank's and end the process now, skipping every collective (teardown included): the
    way out for a rank that cannot know which collective its peers wait in. Its closed connections then fail those
    collectives (gloo: within a second; under torchrun the agent stops the other workers too, NCCL included).
    Its own helpers (dist_checkpointing's writers, reward pools, rollout-server watchdogs) are killed first: os._exit
    would leave them running, holding the launcher's pipes open."""
    import sys

    import psutil

    rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
    print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=5)
    os._exit(code)


def lost_peer(e: BaseException) -> bool:
    """Whether `e` says a collective failed because another rank went away (gloo/NCCL connection errors)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, getattr(dist, "DistBackendError", ())) or any(
                s in str(e) for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                      "NCCL communicator was aborted")):
            return True
        e = e.__cause__ or e.__context__
    return False
