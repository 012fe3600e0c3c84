"""Durable agent steps: checkpoints, the pending side-effect ledger, and approval gates.

A task reaches them through its context: ``ctx.steps(...)`` for checkpointed steps and
``ctx.effect(...)`` for a side effect in a plain task (its single implicit step). The protocol
is described in docs/checkpoints.md.
"""

from checkpoints.ledger import Ledger, Reconciled
from checkpoints.steps import (
    AwaitingApproval,
    CheckpointMissing,
    Decision,
    Step,
    StepClock,
    Steps,
)
from checkpoints.store import CheckpointStore, Fence

__all__ = [
    "AwaitingApproval",
    "CheckpointMissing",
    "CheckpointStore",
    "Decision",
    "Fence",
    "Ledger",
    "Reconciled",
    "Step",
    "StepClock",
    "Steps",
]
