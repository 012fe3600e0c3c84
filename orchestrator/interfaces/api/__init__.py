"""The HTTP API (``orchestrator serve``, docs/api.md): FastAPI routes over the Orchestrator,
bearer-token principals, problem+json errors, external workers and database-woken waits."""
