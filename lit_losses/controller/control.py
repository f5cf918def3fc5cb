"""`TrainerControl`: what an event's actions ask of the trainer, done on every rank once they have run."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class TrainerControl:
    """The requests an action may set (the flags of Hugging Face's ``TrainerControl``); the controller
    then does what each one asks, on every rank (a flag set on any rank is set on all).

    Example:
        >>> control = TrainerControl()
        >>> control.should_training_stop = True
        >>> control.requested()
        ['should_training_stop']
    """

    should_training_stop: bool = False
    """Stop training after this step."""
    should_epoch_stop: bool = False
    """End the current epoch after this optimizer step."""
    should_save: bool = False
    """Save a checkpoint now."""
    should_evaluate: bool = False
    """Run the validation loop now."""
    should_log: bool = False
    """Send the current metrics to the loggers now."""

    def requested(self) -> list[str]:
        """The flags that are set."""
        return [f.name for f in fields(self) if getattr(self, f.name)]
