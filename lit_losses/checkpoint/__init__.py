"""What a checkpoint holds and how a run resumes from it.

`resume` (what a resumed run may change, compared with the checkpoint's options; reading a checkpoint
with a clear error), `stopped_epoch` (an epoch that ``max_steps`` stopped resumes where it stopped),
`preemption` (`PreemptionCheckpoint`: ``SIGTERM`` finishes the step in flight, checkpoints, exits
``128 + signal``).
"""

from lit_losses.checkpoint.preemption import Preempted, PreemptionCheckpoint

__all__ = ["Preempted", "PreemptionCheckpoint"]
