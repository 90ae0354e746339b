import pytest
import torch
import torch.distributed as dist

from raydcp import CheckpointError, Shard
from raydcp.state import flatten_state

from raydcp.planner.layouts import chunk_bounds


def test_nested_dicts_lists_and_tuples_flatten_to_dotted_fqns():
    sd = {"model": {"w": torch.ones(2), "blocks": [torch.zeros(1), {"g": torch.ones(3)}]},
          "optim": {"state": {0: {"exp_avg": torch.ones(2), "step": 3}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
          "pair": (torch.ones(1), "tag"), "names": ["a", "b"]}
    flat = flatten_state(sd)
    assert sorted(flat.tensors) == ["model.blocks.0", "model.blocks.1.g", "model.w", "optim.state.0.exp_avg", "pair.0"]
    assert flat.values == {"optim.state.0.step": 3, "optim.param_groups": [{"lr": 0.1, "params": [0]}],
                           "pair.1": "tag", "names": ["a", "b"]}


def test_load_writes_values_back_into_lists_dicts_and_tuples():
    t = torch.ones(1)
    sd = {"a": {"n": 1}, "l": [torch.zeros(1), 2], "pair": (t, "old")}
    flat = flatten_state(sd, for_load=True)
    flat.finish_load({"a.n": 5, "l.1": 7, "pair.1": "new"})
    assert sd["a"]["n"] == 5 and sd["l"][1] == 7 and sd["pair"] == (t, "new") and sd["pair"][0] is t


class Counter:
    def __init__(self):
        self.n, self.w, self.loaded = 0, torch.zeros(2), None

    def state_dict(self):
        return {"n": self.n, "w": self.w}

    def load_state_dict(self, sd):
        self.loaded = dict(sd)
        self.n = sd["n"]


def test_stateful_objects_expand_and_get_their_state_back():
    c = Counter()
    flat = flatten_state({"c": c, "m": torch.nn.Linear(2, 1)}, for_load=True)
    assert sorted(flat.tensors) == ["c.w", "m.bias", "m.weight"] and flat.values == {"c.n": 0}
    flat.finish_load({"c.n": 9})
    assert c.n == 9 and c.loaded["w"] is c.w


def test_shard_leaf_and_validation():
    flat = flatten_state({"s": Shard(torch.ones(2, 3), (4, 0), (6, 3))})
    leaf = flat.tensors["s"]
    assert leaf.offsets == (4, 0) and leaf.global_shape == (6, 3) and not leaf.replicable
    with pytest.raises(CheckpointError, match="dimension 0 covers"):
        Shard(torch.ones(2, 3), (5, 0), (6, 3))


def test_unsupported_values_name_the_key_and_type():
    with pytest.raises(CheckpointError, match=r"opt\.lock: cannot checkpoint a value of type .*set"):
        flatten_state({"opt": {"lock": {1, 2}}})
    with pytest.raises(CheckpointError, match="sparse|layout"):
        flatten_state({"sp": torch.eye(2).to_sparse()})
    with pytest.raises(CheckpointError, match="same key 'a.b'"):
        flatten_state({"a.b": 1, "a": {"b": 2}})


@pytest.fixture
def fake_rank():
    """Run code as rank r of a fake process group (torch's own test backend: no real collectives)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def enter(rank, world):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield enter
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("mesh_shape,placements,shape", [
    ((4,), "S0", (7, 5)),          # uneven dim-0 pieces
    ((4,), "S0", (3, 2)),          # an empty piece on the last rank
    ((2, 2), "S0S1", (7, 5)),      # 2-D blocks
    ((2, 2), "S0S0", (9, 2)),      # both mesh dims shard dim 0
    ((2, 2), "R_S1", (4, 6)),       # replicated over the first mesh dim
])
def test_dtensor_local_pieces_and_global_offsets(fake_rank, mesh_shape, placements, shape):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard as DShard

    world = 1
    for m in mesh_shape:
        world *= m
    plc = [Replicate() if placements[i] == "R" else DShard(int(placements[i + 1]))
           for i in range(0, len(placements), 2)]
    full = torch.arange(float(torch.tensor(shape).prod())).reshape(shape)
    covered = torch.zeros(shape)
    for rank in range(world):
        fake_rank(rank, world)
        mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))
        coord = mesh.get_coordinate()
        lo, size = [0] * len(shape), list(shape)
        for mdim, p in enumerate(plc):  # expected: torch.chunk along each sharded dim, in mesh order
            if isinstance(p, DShard):
                d = p.dim
                o, n = chunk_bounds(size[d], mesh_shape[mdim], coord[mdim])
                lo[d] += o
                size[d] = n
        local = full[tuple(slice(o, o + n) for o, n in zip(lo, size))].clone()
        dt = DTensor.from_local(local, mesh, plc, run_check=False, shape=torch.Size(shape), stride=full.stride())
        leaf = flatten_state({"x": dt}).tensors["x"]
        assert leaf.offsets == tuple(lo) and tuple(leaf.tensor.shape) == tuple(size)
        assert leaf.global_shape == shape and leaf.replicable == ("R" in placements)
        covered[tuple(slice(o, o + n) for o, n in zip(lo, size))] += 1
    assert torch.all(covered == (2 if "R" in placements else 1))


def test_dtensor_partial_placement_is_refused(fake_rank):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial

    fake_rank(0, 2)
    mesh = DeviceMesh("cpu", torch.arange(2))
    dt = DTensor.from_local(torch.ones(2), mesh, [Partial()], run_check=False)
    with pytest.raises(CheckpointError, match=r"g: DTensor placement P\(sum\) is not supported.*redistribute"):
        flatten_state({"g": dt})
