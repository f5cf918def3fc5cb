"""Errors of lit_losses that stem from configuration; the CLI reports them as one line."""


class ConfigError(ValueError):
    """A configured value is invalid; the message names the value and where it came from."""
