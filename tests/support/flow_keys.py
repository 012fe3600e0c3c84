"""The flow-key template's rule as a model (docs/flow-control.md, "The key"): the rule's one
home is the database's ``orc_flow_key_v1``, which every submit's statement and every claim of a
job without its key runs; tests/test_flow_keys.py holds the two equal over random templates and
payloads, refusals and their messages included."""

from __future__ import annotations

import re
from typing import Any

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
#: The longest key stored: a key is a name, not a payload.
MAX_KEY = 200


class FlowKeyError(ValueError):
    """The key cannot be rendered for this job (a payload field the template names is missing,
    or not a scalar; the key is too long)."""


def render_key(
    template: str, *, job_type: str, tenant_id: str | None, agent_id: str | None, payload: Any
) -> str:
    """The template with each ``{...}`` filled: ``job_type``, ``tenant``, ``agent`` (``-``
    when the job has none) or ``payload.<field>[.<field>...]``, a scalar the payload must hold
    through objects. Everything else is literal. Raises FlowKeyError naming what is wrong."""

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name == "job_type":
            return job_type or "-"
        if name == "tenant":
            return tenant_id or "-"
        if name == "agent":
            return agent_id or "-"
        value: Any = payload
        for part in name.removeprefix("payload.").split("."):
            if not isinstance(value, dict) or part not in value:
                raise FlowKeyError(f"the flow key '{template}' needs {name}, which is missing")
            value = value[part]
        if isinstance(value, dict | list) or value is None:
            raise FlowKeyError(f"the flow key '{template}' needs {name} to be a string or number")
        return str(value).lower() if isinstance(value, bool) else str(value)

    key = _PLACEHOLDER.sub(fill, template)
    if len(key) > MAX_KEY:
        raise FlowKeyError(f"the flow key is {len(key)} characters long, over {MAX_KEY}")
    return key
