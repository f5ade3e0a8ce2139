"""While a new rank replays a session's setup cells alone, torch.distributed's collectives
refuse at once (the survivors would never join them), wherever they are reached by name;
before and after, they are torch's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import device_mesh
from torch.distributed import distributed_c10d as c10d

from elastic_magic import torch_internals
from elastic_magic.worker.replay_alone import COLLECTIVES, AloneError, no_collectives

pytestmark = pytest.mark.unit


def test_collectives_refuse_only_while_replayed_alone_and_are_torchs_again_after():
    names = (*COLLECTIVES, *torch_internals.private_collectives())
    assert all(hasattr(dist, name) for name in names)  # each is torch's in this torch
    before = {name: getattr(dist, name) for name in names}
    mesh_new_group = device_mesh.new_group
    with no_collectives():
        from torch.distributed import all_reduce  # a setup cell binding one by name
        for call in (lambda: dist.barrier(), lambda: c10d.broadcast(torch.ones(1), 0),
                     lambda: all_reduce(torch.ones(1)),
                     lambda: dist._verify_params_across_processes(None, []),
                     lambda: device_mesh.new_group([0]),  # imported there by name
                     lambda: dist.init_process_group("gloo")):
            with pytest.raises(AloneError, match="in a setup cell replayed on a new rank"):
                call()
        # what reads the group without waiting for others is left alone
        assert dist.is_initialized() is False
        dist.scatter = mine = lambda *args: None  # the cell's own replacement stays
    try:
        assert dist.scatter is mine
        del before["scatter"]
        assert {name: getattr(dist, name) for name in before} == before
        assert c10d.barrier is before["barrier"] and device_mesh.new_group is mesh_new_group
        # the name bound during the replay calls torch's now: here, torch's own complaint
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            all_reduce(torch.ones(1))
    finally:
        dist.scatter = c10d.scatter
