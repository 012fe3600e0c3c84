"""Two names the retry config shares with every submit, each ruled here once (this package is the
lowest layer: the orchestrator's domain, storage and interfaces read these definitions, and the
config's own models check its files by them).

- **A queue the orchestrator reserves** (``RESERVED_QUEUES``): the maintenance queue, every
  worker's one maintenance slot, where the zombie sweep, the retry safety net, approval expiry,
  pruning, retention and the rollups tick. No job goes there: a submit naming it (the API, the
  Python API, the command line, a batch), a schedule naming it, or a job type whose queue it is
  (in this file, or by its name) is refused (docs/api.md, "Queues the orchestrator reserves").
- **A limit the orchestrator owns** (``RESERVED_LIMITS``): the limit of Graphile Worker's serial
  queues, which its schema writes (docs/graphile.md); a config's ``[limits.<name>]`` of that name
  is refused, since the config's sync never changes a limit it does not own.
- **A tenant** (``tenant_refusal``): 1 to 200 characters, not all of them whitespace. An empty
  or blank tenant (an unset shell variable gives one) names nobody: refused wherever a tenant is
  named, so it can neither own a job nor limit a token (docs/operations.md, "Tokens").
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

#: The maintenance services' queue: the maintenance lane of every worker takes only it.
MAINTENANCE_QUEUE = "maintenance"
#: The queues no job may be put on.
RESERVED_QUEUES = frozenset({MAINTENANCE_QUEUE})

#: The flow limits no config may define: Graphile Worker's serial queues' (its schema writes it).
RESERVED_LIMITS = frozenset({"graphile_worker_queue"})

#: The longest tenant, in characters (the job table's ``tenant_id`` holds as many).
MAX_TENANT = 200


def queue_refusal(queue: str) -> str | None:
    """Why no job may go on ``queue``, or None when one may."""
    if queue in RESERVED_QUEUES:
        return (
            f"queue {queue!r} is reserved by the orchestrator (its maintenance tasks' queue, "
            "every worker's one maintenance slot); put the job on another queue"
        )
    return None


def open_queue(queue: str) -> str:
    """``queue``, or ValueError when it is reserved (a pydantic validator)."""
    reason = queue_refusal(queue)
    if reason is not None:
        raise ValueError(reason)
    return queue


def limit_refusal(name: str) -> str | None:
    """Why no config may define the limit ``name``, or None when one may."""
    if name in RESERVED_LIMITS:
        return (
            f"limit {name!r} is reserved by the orchestrator (the limit of Graphile Worker's "
            "serial queues, docs/graphile.md); name the limit otherwise"
        )
    return None


def tenant_refusal(tenant: str) -> str | None:
    """Why ``tenant`` names no tenant, or None when it does."""
    if not tenant.strip():
        shown = "empty" if not tenant else f"only whitespace ({tenant!r})"
        return f"a tenant cannot be {shown}: name one, or leave the tenant out"
    if len(tenant) > MAX_TENANT:
        return f"a tenant has at most {MAX_TENANT} characters, not {len(tenant)}"
    return None


def named_tenant(tenant: str) -> str:
    """``tenant``, or ValueError saying why it names no tenant (a pydantic validator)."""
    reason = tenant_refusal(tenant)
    if reason is not None:
        raise ValueError(reason)
    return tenant


#: A queue a job may go on: 1 to 128 characters, not a reserved one.
Queue = Annotated[str, Field(min_length=1, max_length=128), AfterValidator(open_queue)]
#: A tenant: 1 to 200 characters, not all whitespace.
TenantId = Annotated[str, Field(min_length=1, max_length=MAX_TENANT), AfterValidator(named_tenant)]
