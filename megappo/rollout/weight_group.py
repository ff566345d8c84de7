"""A process group between the trainer and rollout servers, outside the trainer's own world.

SGLang's `/init_weights_update_group` makes each server TP rank join a group of its own (trainer rank 0, server
ranks from `rank_offset`) through torch's TCP rendezvous; the trainer must join the *same* kind of group, which
`torch.distributed.new_group` cannot make (it only splits the default world). This mirrors SGLang's
`init_custom_process_group` (torch's `_new_process_group_helper` on a prefixed TCP store), the same private API
every system syncing into SGLang uses.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any


def init_weight_group(master_address: str, master_port: int, *, rank: int, world_size: int, group_name: str,
                      backend: str = "gloo", timeout: timedelta = timedelta(minutes=10)) -> Any:
    """Join (rank 0: host) the group `group_name` of `world_size` ranks; returns the ProcessGroup."""
    import torch
    from torch.distributed.distributed_c10d import (
        Backend, PrefixStore, _new_process_group_helper, _world, rendezvous,
    )

    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    options = "backend_options" if version >= (2, 6) else "pg_options"
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      **{options: None}, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
