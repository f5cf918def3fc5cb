"""``python -m lit_losses.cli …`` is ``lit-losses …``."""

from lit_losses.cli.app import main

main()
