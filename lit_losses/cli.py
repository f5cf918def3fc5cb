"""``lit-losses``: the LightningCLI entry point (``fit``, ``validate``, ``predict``, ``test``).

The model is any `RegularizedLM` subclass (``model.class_path``, e.g. `lit_losses.TinyLM`); the data
is any LightningDataModule (``data.class_path``, e.g. `lit_losses.TextDataModule`). With a data module
that has a ``vocab_size`` (as `TextDataModule`), it is linked to ``model.init_args.vocab_size``.
Configuration errors (`ConfigError`) are reported as one ``error:`` line, before training starts.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

from lit_losses.data.text import TextDataModule
from lit_losses.errors import ConfigError
from lit_losses.module import RegularizedLM


class LitLossesCLI(LightningCLI):
    """LightningCLI with the data→model vocabulary link and one-line configuration errors."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults(
            {
                "model": {"class_path": "lit_losses.TinyLM"},
                "data": {"class_path": "lit_losses.TextDataModule"},
            }
        )
        parser.link_arguments("data.init_args.vocab_size", "model.init_args.vocab_size")

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as err:
            _fail_on_config_error(err)
            raise

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except Exception as err:
            _fail_on_config_error(err)
            raise


def _fail_on_config_error(err: BaseException) -> None:
    """Exit with one line if a `ConfigError` caused ``err`` (jsonargparse wraps the ones it meets)."""
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, ConfigError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        print(f"lit-losses: error: {cause}", file=sys.stderr)
        sys.exit(2)


def cli_main(args: list[str] | None = None) -> LitLossesCLI:
    """Run ``lit-losses`` with ``args`` (default: ``sys.argv[1:]``) and return the CLI object."""
    return LitLossesCLI(
        RegularizedLM,
        TextDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


def main() -> None:
    """Console-script entry point ``lit-losses`` (exit status 0 on success)."""
    cli_main()


if __name__ == "__main__":
    main()
