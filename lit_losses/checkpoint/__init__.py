"""What a checkpoint holds, how it is verified, and how a run resumes from it (on any topology).

`resume` (what a resumed run may change, compared with the checkpoint's options; reading a checkpoint
with a clear error), `stopped_epoch` (an epoch that ``max_steps`` stopped resumes where it stopped),
`preemption` (`PreemptionCheckpoint`: ``SIGTERM`` finishes the step in flight, checkpoints, exits
``128 + signal``), `manifest` (every file's size and SHA-256, a folder's commit marker), `verify`
(`verify_checkpoint`: checked before anything is restored), `verified` (`VerifiedCheckpoints`: every
checkpoint written aside with its manifest, then renamed; read on any layout), `latest`
(`latest_checkpoint`: ``--ckpt_path last``), `topology` (the data position recounted for another number of
data-parallel ranks), `reshard` (a sharded folder read whole, a file loaded into a sharded model),
`convert` (`convert_checkpoint`: a sharded folder as one file, and back).
"""

from lit_losses.checkpoint.convert import convert_checkpoint
from lit_losses.checkpoint.latest import checkpoint_folders, latest_checkpoint
from lit_losses.checkpoint.preemption import Preempted, PreemptionCheckpoint
from lit_losses.checkpoint.topology import Topology
from lit_losses.checkpoint.verified import VerifiedCheckpoints
from lit_losses.checkpoint.verify import Verification, verify_checkpoint

__all__ = [
    "Preempted",
    "PreemptionCheckpoint",
    "Topology",
    "Verification",
    "VerifiedCheckpoints",
    "checkpoint_folders",
    "convert_checkpoint",
    "latest_checkpoint",
    "verify_checkpoint",
]
