"""``lit-losses``: the LightningCLI entry point (``fit``, ``validate``, ``predict``, ``test``).

The model is any `RegularizedLM` subclass (``model.class_path``, default `TinyLM`); the data is any
LightningDataModule (``data.class_path``, default `TextDataModule`). With `TextDataModule`,
``data.vocab_size`` is linked to ``model.init_args.vocab_size``.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from lit_losses.data.text import TextDataModule
from lit_losses.module import RegularizedLM


class LitLossesCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.init_args.vocab_size", "model.init_args.vocab_size")


def main(args: list[str] | None = None) -> LitLossesCLI:
    return LitLossesCLI(
        RegularizedLM,
        TextDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":
    main()
