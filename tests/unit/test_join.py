"""The launchers' join check (megappo/platform/join.py): node 0 names the node ranks that did not come, with the
Slurm host names it was given, and a node that cannot reach node 0 names the address; all joined is exit 0."""
from __future__ import annotations

import threading

from megappo.platform.join import join
from megappo.testing.dist import free_port


def test_missing_nodes_are_named_with_their_hosts(capfd):
    assert join(3, 0, "127.0.0.1", free_port(), timeout_s=1, hosts=["n0", "n1", "n2"]) == 2
    err = capfd.readouterr().err
    assert "node rank(s) 1 (n1), 2 (n2) of 3 did not join within 1 s" in err and "joined: 0 (" in err


def test_every_node_joined(capfd):
    port, codes = free_port(), {}
    others = [threading.Thread(target=lambda r=r: codes.__setitem__(r, join(3, r, "127.0.0.1", port, nproc=2,
                                                                           timeout_s=20))) for r in (1, 2)]
    for t in others:
        t.start()
    codes[0] = join(3, 0, "127.0.0.1", port, nproc=2, timeout_s=20)
    for t in others:
        t.join(30)
    assert codes == {0: 0, 1: 0, 2: 0}
    assert "all 3 nodes joined" in capfd.readouterr().err


def test_a_node_that_cannot_reach_node_0_names_the_address(capfd):
    port = free_port()
    assert join(2, 1, "127.0.0.1", port, timeout_s=1) == 2
    assert f"node 1 could not reach node 0 at 127.0.0.1:{port} within 1 s" in capfd.readouterr().err
