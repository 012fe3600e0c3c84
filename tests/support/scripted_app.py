"""The scripted job types (tests/support/scripted.py) as an application for worker processes:
``orchestrator --app tests.support.scripted_app:orc worker``. Settings come from the
environment; its retry config is CONFIG."""

from __future__ import annotations

from orchestrator import Orchestrator
from tests.support import scripted
from tests.support.harness import config_with

CONFIG = config_with(scripted.TABLE)
orc = Orchestrator()
scripted.register(orc)
