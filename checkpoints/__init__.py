"""Durable agent steps: checkpoints and the pending side-effect ledger.

Not built yet: this package arrives with the checkpoints milestone (see docs/architecture.md).
"""
