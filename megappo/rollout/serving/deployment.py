"""Servers shared by every data-parallel replica, as a `RolloutDeployment`: the run's `ServerSet` on every rank, a
fleet client on each replica's first rank (the holder), global rank 0's fleet the sync target. Before each sync, dead
servers are restarted (or dropped) collectively (`ServerSet.heal`) and every client is told, so the sync that
follows gives a restarted server the current weights. SGLang's and vLLM's deployments are this with their server set
and fleet."""
from __future__ import annotations

from typing import Any, Callable

from megappo.rollout.base import RolloutDeployment
from megappo.rollout.serving.server_set import ServerSet


class ServedDeployment(RolloutDeployment):
    """`servers` (not started yet) and `make_fleet(servers)`, the holder's fleet over them."""

    def __init__(self, servers: ServerSet, make_fleet: Callable[[ServerSet], Any], ps: Any):
        import torch.distributed as dist

        self.servers = servers
        self.servers.start()
        fleet = None
        try:
            if dist.get_rank(ps.mp_group) == 0:
                fleet = make_fleet(self.servers)
                fleet.log_dir = self.servers.r.log_dir  # its errors quote the logs of the servers that failed
        except BaseException:
            self.servers.stop()
            raise
        super().__init__(fleet, fleet if dist.get_rank() == 0 else None)

    def prepare_sync(self) -> dict[str, float]:
        """Collective: dead servers restarted (or dropped) and every client told."""
        fleet = self.engine
        dropped = {fleet.urls[k] for k, ok in enumerate(fleet.alive) if not ok} if fleet is not None else set()
        if self.servers.heal(dropped) and fleet is not None:
            fleet.set_servers(self.servers.urls, self.servers.alive, self.servers.router_url)
        return self.health()

    def health(self) -> dict[str, float]:
        """rollout/retried_samples: samples this holder's fleet sent to another server after one failed, since the
        start (global rank 0's view, as every logged metric)."""
        fleet = self.engine
        return {"rollout/servers_live": float(sum(self.servers.alive)),
                "rollout/server_restarts": float(self.servers.restarts),
                "rollout/retried_samples": float(fleet.retried_rows if fleet is not None else 0)}

    def close(self) -> None:
        super().close()  # the weight groups first: the servers' ranks go with the servers
        self.servers.stop()
