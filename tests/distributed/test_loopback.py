"""The loopback process group: rank R of a world of N in one process, each collective filled as
if every other rank were a copy of this one (glmtune/distributed/loopback.py). Each kind is
checked through the entry points its callers use (torch.distributed, the functional
collectives, a DeviceMesh); FSDP2 and the token dispatcher are checked against real gloo ranks
in tests/plan/test_measure.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import init_device_mesh

from glmtune.distributed.loopback import join_loopback_world, moved_bytes_by_group


def test_collectives_fill_as_if_every_rank_were_this_one():
    with join_loopback_world(2, 4):
        assert (dist.get_rank(), dist.get_world_size()) == (2, 4)
        shard = torch.arange(3.0)
        gathered = torch.full((12,), -1.0)
        dist.all_gather_into_tensor(gathered, shard)
        assert gathered.tolist() == [0.0, 1.0, 2.0] * 4
        parts = [torch.empty(3) for _ in range(4)]
        dist.all_gather(parts, shard)
        assert all(torch.equal(p, shard) for p in parts)

        full = torch.arange(8.0)
        mine = torch.empty(2)
        dist.reduce_scatter_tensor(mine, full)  # SUM over 4 copies of this rank's input
        assert mine.tolist() == [16.0, 20.0]  # 4 x full[4:6]
        value = torch.tensor([1.5])
        dist.all_reduce(value)
        assert value.item() == 6.0
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        assert value.item() == 6.0

        sent = torch.arange(6.0)
        received = torch.empty(6)
        dist.all_to_all_single(received, sent, [1, 2, 0, 3], [1, 2, 0, 3])
        assert torch.equal(received, sent)  # what goes to rank s comes back as what s sends


def test_autograd_all_to_all_and_sizes_moved():
    with join_loopback_world(0, 2):
        x = torch.arange(4.0, requires_grad=True)
        out = torch.ops._c10d_functional.wait_tensor(all_to_all_single_autograd(x, [3, 1], [3, 1], dist.group.WORLD))
        (out * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
        assert torch.equal(out, x.detach()) and x.grad.tolist() == [1.0, 2.0, 3.0, 4.0]
        moved = moved_bytes_by_group()
        [(name, world)] = moved.items()
        assert world["ranks"] == [0, 1] and world["bytes"]["all_to_all"] == 2 * 4 * 4  # forward and backward


def test_send_then_receive_returns_the_last_sent_and_otherwise_a_hidden_state_scale():
    with join_loopback_world(1, 2):
        fresh = torch.empty(1000)
        dist.recv(fresh, 0)
        assert 0.8 < fresh.std().item() < 1.2  # normal(0, 1): a later stage's input, never zeros
        vote = torch.full((4,), 7, dtype=torch.long)
        dist.recv(vote, 0)
        assert vote.tolist() == [1, 1, 1, 1]
        sent = torch.randn(5, 3)
        dist.send(sent, 0)
        back = torch.empty(5, 3, requires_grad=True)  # a pipeline's leaf buffer
        dist.recv(back, 0)
        assert torch.equal(back.detach(), sent)


def test_a_device_mesh_over_the_world_names_its_groups():
    with join_loopback_world(5, 8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
        assert mesh["dp"].get_local_rank() == 1 and mesh["pp"].get_local_rank() == 1
        assert dist.get_process_group_ranks(mesh["dp"].get_group()) == [4, 5, 6, 7]


def test_refusals():
    with pytest.raises(ValueError, match="ranks 0..3"):
        with join_loopback_world(4, 4):
            pass
    with join_loopback_world(0, 2):
        with pytest.raises(ValueError, match="process group exists already"):
            with join_loopback_world(0, 2):
                pass
    assert not dist.is_initialized()
