"""``python -m lit_losses.cli …`` is ``lit-losses …``."""

from lit_losses.cli.entry import main

main()
