"""`HFCausalLM`'s sharding defaults: FSDP2 units are the model's decoder layers (with their LoRA adapters),
the tensor-parallel plan shards the output projection along the vocabulary; the options round-trip."""

import pytest

pytest.importorskip("transformers")

from lit_losses import HFCausalLM
from lit_losses.errors import ConfigError
from lit_losses.parallel.plan import fsdp_units

CONFIG = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
}


@pytest.mark.parametrize("lora", [None, {"r": 2, "target_modules": ["q_proj"]}])
def test_fsdp_units_are_the_decoder_layers_with_their_adapters(lora):
    model = HFCausalLM(config=CONFIG, lora=lora, parallel={"reshard_after_forward": False})
    units = fsdp_units(model, None)
    assert [type(u).__name__ for u in units] == ["LlamaDecoderLayer"] * 2
    if lora:
        assert any("lora" in name for name, _ in units[0].named_parameters())
    weight = model.output_projection()[0]
    assert all(all(p is not weight for p in u.parameters()) for u in units)  # the head reads the root's
    assert model.parallel_config.reshard_after_forward is False


@pytest.mark.parametrize(
    ("tied", "expected"),
    [(True, {"model.model.embed_tokens": "embedding"}), (False, {"model.lm_head": "colwise"})],
)
def test_the_tensor_parallel_plan_shards_the_vocabulary(tied, expected):
    model = HFCausalLM(config={**CONFIG, "tie_word_embeddings": tied})
    assert model.tensor_parallel_plan == expected


def test_a_model_without_decoder_layer_classes_asks_for_fsdp_modules():
    model = HFCausalLM(config=CONFIG)
    model.model._no_split_modules = []
    with pytest.raises(ConfigError, match=r"set model\.init_args\.parallel\.fsdp_modules"):
        fsdp_units(model, None)
