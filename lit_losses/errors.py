"""Errors of lit_losses that stem from configuration; the CLI reports them as one line."""


class ConfigError(ValueError):
    """A configured value is invalid; the message names the value and where it came from."""


class BatchKeyError(ConfigError, KeyError):
    """A batch key that a configured loss term reads is missing from the data (a `ConfigError` and a
    ``KeyError``); the message names the key, who reads it and the keys the batch has."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
