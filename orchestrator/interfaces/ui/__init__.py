"""The dashboard (``orchestrator serve`` at ``/ui``, docs/ui.md): server-rendered pages, a little
plain JavaScript, and the API's principals, over the same Orchestrator."""
