"""The parallel plan on one process: which modules FSDP2 shards, the refusals of a bad plan, and gradient
clipping across device meshes (plain tensors here; DTensors in `tests/parallel/test_model_parallel.py`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_losses import TinyLM
from lit_losses.errors import ConfigError
from lit_losses.parallel import ParallelConfig, fsdp_units
from lit_losses.parallel.clipping import clip_grad_norm_by_mesh, spans_meshes
from lit_losses.parallel.plan import apply_fsdp, apply_tensor_parallel


def tiny(**kwargs) -> TinyLM:
    return TinyLM(vocab_size=16, d_model=8, n_layers=2, n_heads=2, **kwargs)


class TwoStacks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
        self.heads = nn.ModuleList([nn.Sequential(nn.ModuleList([nn.Linear(2, 2)]))])


def test_fsdp_units_default_to_the_model_attribute_then_module_list_items():
    model = tiny()
    assert fsdp_units(model, None) == list(model.body.blocks)  # TinyLM.fsdp_modules
    stacks = TwoStacks()
    units = fsdp_units(stacks, None)  # every item of every ModuleList, deepest first
    assert units[0] is stacks.heads[0][0][0]
    assert {id(u) for u in units} == {id(m) for m in (*stacks.layers, stacks.heads[0], stacks.heads[0][0][0])}
    assert fsdp_units(model, ["body.blocks.1", "body.norm"]) == [model.body.blocks[1], model.body.norm]


def test_a_pattern_that_matches_nothing_is_a_config_error():
    with pytest.raises(ConfigError, match=r"fsdp_modules: 'body\.blokcs\.\*' matches no submodule of TinyLM"):
        fsdp_units(tiny(), ["body.blokcs.*"])


def test_the_output_projection_must_stay_in_the_root_unit():
    config = ParallelConfig(fsdp_modules=["body.embed"])  # tied: the embedding is the output projection
    with pytest.raises(ConfigError, match=r"'body\.embed' holds the output projection"):
        apply_fsdp(tiny(), None, config)  # refused before any sharding


def test_tensor_parallel_needs_a_plan_naming_real_modules():
    class Mesh:
        def size(self) -> int:
            return 2

    with pytest.raises(ConfigError, match="tensor_parallel_size=2 but TwoStacks has no tensor-parallel plan"):
        apply_tensor_parallel(TwoStacks(), Mesh(), None)
    with pytest.raises(ConfigError, match="TinyLM has no module 'lm_head'"):
        apply_tensor_parallel(tiny(), Mesh(), {"lm_head": "colwise"})  # tied: there is no lm_head
    assert tiny(tie_embeddings=False).tensor_parallel_plan == {"lm_head": "colwise"}
    assert tiny().tensor_parallel_plan == {"body.embed": "embedding"}


def test_config_values_are_checked():
    with pytest.raises(ConfigError, match=r"tensor_parallel_plan\['lm_head'\] 'column'"):
        ParallelConfig(tensor_parallel_plan={"lm_head": "column"})
    with pytest.raises(ConfigError, match=r"fsdp_modules\[0\]=3 must be a string \(name patterns\)"):
        ParallelConfig(fsdp_modules=[3])
    with pytest.raises(ConfigError, match=r"fsdp_modules='body.blocks.\*' is one string; give a list"):
        ParallelConfig(fsdp_modules="body.blocks.*")
    assert ParallelConfig.coerce(None) == ParallelConfig()
    assert tiny(parallel={"reshard_after_forward": False}).parallel_config.reshard_after_forward is False


def test_clipping_by_mesh_equals_torch_on_plain_tensors():
    g = torch.Generator().manual_seed(0)
    params = [torch.zeros(n, requires_grad=True) for n in (3, 5, 7)]
    twins = [torch.zeros(n, requires_grad=True) for n in (3, 5, 7)]
    for p, q in zip(params, twins, strict=True):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad.clone()
    assert not spans_meshes(params)
    total = clip_grad_norm_by_mesh(params, 0.5)
    expected = torch.nn.utils.clip_grad_norm_(twins, 0.5)
    torch.testing.assert_close(total.float(), expected)
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_fsdp_off_with_several_data_parallel_ranks_is_refused():
    from lit_losses.parallel import parallelize

    class Mesh:  # a (data_parallel=2, tensor_parallel=1) mesh, as Lightning builds it
        mesh_dim_names = ("data_parallel", "tensor_parallel")

        def __getitem__(self, name):
            return type("Dim", (), {"size": lambda self: 2 if name == "data_parallel" else 1})()

    with pytest.raises(ConfigError, match="fsdp: false with data_parallel_size=2: nothing would average"):
        parallelize(tiny(), Mesh(), ParallelConfig(fsdp=False))
