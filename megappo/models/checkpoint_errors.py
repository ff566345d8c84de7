"""The errors of model checkpoints (`megappo.models.checkpoint`, `megappo.models.optim_state`)."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A missing, incomplete or mismatching checkpoint; the message names the directory/file/tensor."""


class SaveAbandoned(CheckpointError):
    """This rank's part of a collective save failed where the other ranks cannot see it (megatron's rank-0 writes
    of common.pt and metadata.json, say): they wait in one of the save's collectives that this rank will never join.
    The catcher must enter no further collective (it would hang, or pair with the wrong one): report and leave the
    process (`megappo.parallel.leave_run`), which fails the collectives the others wait in."""
