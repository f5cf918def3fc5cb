import torch

from lit_losses.hparams import plain_data
from lit_losses.optim import OptimizerConfig
from lit_losses.regularizers import RegularizerSpec


def custom_term(ctx):
    return ctx.logprobs


def test_dataclasses_become_dicts_and_callables_import_paths():
    hparams = {
        "optimizer": OptimizerConfig(lr=0.5),
        "regularizers": [RegularizerSpec("mine", fn=custom_term, schedule={"kind": "step", "step_size": 3})],
    }
    plain = plain_data(hparams)
    assert plain["optimizer"]["lr"] == 0.5 and plain["optimizer"]["betas"] == (0.9, 0.95)
    spec = plain["regularizers"][0]
    assert spec["fn"] == f"{__name__}.custom_term" and spec["schedule"]["step_size"] == 3
    assert plain_data(lambda x: x).startswith("<function")  # no import path: its repr
    torch.save(plain, "/dev/null")  # plain data only: loadable with weights_only=True


def test_plain_data_round_trips_through_the_configs():
    plain = plain_data(OptimizerConfig(lr=0.25, schedule="linear"))
    assert OptimizerConfig.coerce(plain) == OptimizerConfig(lr=0.25, schedule="linear")
