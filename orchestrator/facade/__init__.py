"""The Orchestrator's concerns, one module each: ``orchestrator.app`` holds the entry point and
hands each of its methods to one of them (docs/architecture.md)."""
