"""The default application: every built-in job type, configured from the environment."""

from orchestrator import Orchestrator
from tasks import register_all

orc = Orchestrator()
register_all(orc)
