"""A process group between the trainer and rollout servers, outside the trainer's own world.

SGLang's `/init_weights_update_group` makes each server TP rank join a group of its own (trainer rank 0, server
ranks from `rank_offset`) through torch's TCP rendezvous; the trainer must join the *same* kind of group, which
`torch.distributed.new_group` cannot make (it only splits the default world). This mirrors SGLang's
`init_custom_process_group` (torch's `_new_process_group_helper` on a prefixed TCP store), the same private API
every system syncing into SGLang uses.

What is exposed, and for how long:
- The rendezvous store (torch's TCPStore, unauthenticated: whoever connects can read and write its keys) is hosted
  by the trainer (rank 0) on `master_address:master_port` only, not on every interface: rank 0 binds the listening
  socket itself and hands it to the store (`master_listen_fd`), because TCPStore(host_name=...) binds the wildcard
  address whatever host it is given. Single node: 127.0.0.1, reachable by local processes only. Multi-node: the
  trainer node's address on the network the servers use, reachable by every host of that network. The store lives
  as long as the group (the process group keeps it), i.e. until `destroy_process_group`.
- `timeout` (seconds, default 30) bounds the rendezvous (a server that never joins fails it) and every collective
  of the group (a server that dies mid-broadcast fails the broadcast), instead of torch's ten minutes.
- The collectives' own connections are not bound here: gloo listens on the address of this host's name (or the
  interface named by GLOO_SOCKET_IFNAME), NCCL on NCCL_SOCKET_IFNAME's; torch's `_new_process_group_helper` does not
  take a gloo device, so pin them with those variables on multi-node runs.
"""
from __future__ import annotations

import itertools
import os
import socket
from datetime import timedelta
from typing import Any, Union

_GROUP_IDS = itertools.count()


def unique_group_name(base: str) -> str:
    """`base` made unique in this process: torch keeps a group's name until the group is destroyed, so a second
    engine or fleet in one process (a distillation teacher's, a second run in a notebook or a test session) must not
    take the name of one that was never closed."""
    return f"{base}_{os.getpid()}_{next(_GROUP_IDS)}"


def _listening_socket(address: str, port: int) -> socket.socket:
    """A socket listening on `address:port` only (IPv4 or IPv6, a name is resolved)."""
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    # a name with both kinds of address ("localhost"): IPv4 first, as the servers' connect most likely resolves it
    family, kind, proto, _, sockaddr = sorted(infos, key=lambda i: i[0] != socket.AF_INET)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def _store(master_address: str, master_port: int, rank: int, world_size: int, timeout: timedelta) -> Any:
    from torch.distributed import TCPStore

    if rank != 0:
        return TCPStore(master_address, master_port, world_size, False, timeout)
    sock = _listening_socket(master_address, master_port)
    fd = sock.detach()  # the store owns the descriptor from here on (it closes it when it is destroyed)
    try:
        return TCPStore(master_address, master_port, world_size, True, timeout, wait_for_workers=False,
                        master_listen_fd=fd)
    except BaseException:
        socket.close(fd)
        raise


def init_weight_group(master_address: str, master_port: int, *, rank: int, world_size: int, group_name: str,
                      backend: str = "gloo", timeout: Union[float, timedelta] = 30.0) -> Any:
    """Join (rank 0: host) the group `group_name` of `world_size` ranks; returns the ProcessGroup. `timeout`:
    seconds (or a timedelta) for the rendezvous and for each collective."""
    import torch
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    # not torch's rendezvous(): it binds every interface, and under torchrun (TORCHELASTIC_USE_AGENT_STORE) it
    # makes rank 0 a client of a store that nobody hosts
    store = PrefixStore(group_name, _store(master_address, master_port, rank, world_size, timeout))
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    options = "backend_options" if version >= (2, 6) else "pg_options"
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      **{options: None}, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
