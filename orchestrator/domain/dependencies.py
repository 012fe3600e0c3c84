"""Dependencies (docs/workflows.md): what a job waits for, named at submit, and what it does
when one of them fails for good or is cancelled. Pure: the submit resolves a batch's
references to job ids here before anything is sent; the database checks the parents' tenant
and existence, and runs the graph (functions/dependencies.sql)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.domain.errors import SubmitError

#: What a job does when a parent fails for good or is cancelled: ``cancel`` (it is cancelled,
#: and so on down the graph), ``run`` (it runs, and reads the failure in ``ctx.parents()``),
#: ``wait`` (it stays blocked while the parent's dead letter is open: a requeue that then
#: completes releases it, a discard cancels it).
ParentPolicy = Literal["cancel", "run", "wait"]
#: The most parents one job may name.
MAX_PARENTS = 10_000

#: An earlier job of the same batch, by its place in it (0 is the first).
BatchIndex = Annotated[int, Field(ge=0)]


class Dependency(BaseModel):
    """A parent, with its policy (None: the job type's, ``on_parent_failure``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: UUID | BatchIndex = Field(
        description="a job's id, or the index of an earlier job in the same batch"
    )
    on_failure: ParentPolicy | None = None


#: What ``depends_on`` takes: a job id, a batch index, or a Dependency with its policy.
ParentRef = UUID | BatchIndex | Dependency


def edges(
    depends_on: Sequence[Sequence[ParentRef]],
    ids: Sequence[str],
    keyed: Sequence[bool],
    defaults: Sequence[ParentPolicy],
) -> list[list[dict[str, str]] | None]:
    """Each job's parents as the submit's statement takes them (``{job_id, on_failure}``, in
    order; None for a job without), a batch index resolved to that job's id. Refused
    (SubmitError naming the job and the parent): an index not before the job's own (so no
    graph can have a cycle), one of a job with a job key (a keyed submit may return another
    job), a parent named twice, a job with a job key that has parents."""
    resolved: list[list[dict[str, str]] | None] = []
    for n, parents in enumerate(depends_on):
        if not parents:
            resolved.append(None)
            continue
        if keyed[n]:
            raise SubmitError(f"job {n} of the submit: depends_on is not taken with a job_key")
        out: list[dict[str, str]] = []
        for parent in parents:
            dependency = parent if isinstance(parent, Dependency) else Dependency(job=parent)
            job = dependency.job
            if isinstance(job, int):
                if job >= n:
                    raise SubmitError(
                        f"job {n} of the submit: depends_on names job {job} of the submit, "
                        "which is not before it"
                    )
                if keyed[job]:
                    raise SubmitError(
                        f"job {n} of the submit: depends_on names job {job} of the submit, "
                        "which has a job_key (name a keyed job by its id once submitted)"
                    )
                job_id = ids[job]
            else:
                job_id = str(job)
            if any(e["job_id"] == job_id for e in out):
                raise SubmitError(f"job {n} of the submit: depends_on names {job_id} twice")
            out.append({"job_id": job_id, "on_failure": dependency.on_failure or defaults[n]})
        resolved.append(out)
    return resolved
