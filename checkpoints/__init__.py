"""Durable agent steps: checkpoints, the pending side-effect ledger, and approval gates.

A task reaches them through its context: ``ctx.steps(...)`` for checkpointed steps and
``ctx.effect(...)`` for a side effect in a plain task (its single implicit step); a step spawns
children and waits for them (``step.spawn``, ``step.wait_for``: docs/workflows.md). The protocol
is described in docs/checkpoints.md.

This package sits on the orchestrator's domain and storage layers (it imports nothing from the
runtime above them); the runtime hands each attempt its ledger and gate.
"""

from checkpoints.children import AwaitingChildren, Children
from checkpoints.gate import ApprovalGate, AwaitingApproval
from checkpoints.ledger import Ledger, Reconciled
from checkpoints.steps import ApprovalDecision, CheckpointMissing, Step, StepClock, Steps
from checkpoints.store import CheckpointStore
from orchestrator.domain.models import Fence

__all__ = [
    "ApprovalDecision",
    "ApprovalGate",
    "AwaitingApproval",
    "AwaitingChildren",
    "CheckpointMissing",
    "CheckpointStore",
    "Children",
    "Fence",
    "Ledger",
    "Reconciled",
    "Step",
    "StepClock",
    "Steps",
]
