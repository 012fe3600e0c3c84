"""Job types: the decorated task functions, with their payload and result types.

``@orc.job_type("name")`` on ``async def fn(ctx, payload: Model) -> Result`` records the
function with pydantic adapters built from its annotations: the payload is validated at submit
(nothing is stored when it does not fit) and again at dispatch, the result before it is stored.
An unannotated payload or result accepts any JSON value.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from orchestrator.domain import json_values
from orchestrator.domain.degradation import Fallback, TypeDegradation
from orchestrator.domain.dependencies import ParentPolicy
from orchestrator.domain.errors import InvalidOutput, InvalidPayload

#: ``async def fn(ctx, payload) -> result``; ``ctx`` is the runtime's JobContext, which this
#: layer, below the runtime, does not name.
JobFunction = Callable[[Any, Any], Awaitable[Any]]
NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$")
MAX_NAME = 100  # Procrastinate task and queue names are varchar(128), with our prefix


@dataclass(frozen=True)
class JobType:
    name: str
    fn: JobFunction
    payload: TypeAdapter[Any]
    result: TypeAdapter[Any]
    #: Run when a job of this type has FAILED for good, instead of notifying a human
    #: (orchestrator.domain.degradation): given the stored payload, the content it keeps.
    fallback: Fallback | None = None
    #: What the human notification says when the type's transient failures spent its budget.
    exhausted_message: str | None = None
    #: A job's estimated cost in its limit's units, from its typed payload (docs/flow-control.md).
    cost: Callable[[Any], int] | None = None
    #: What a job of this type does when a parent fails for good or is cancelled, unless its
    #: submit says (docs/workflows.md).
    on_parent_failure: ParentPolicy = "cancel"

    @classmethod
    def from_function(
        cls,
        name: str,
        fn: JobFunction,
        *,
        fallback: Fallback | None = None,
        exhausted_message: str | None = None,
        cost: Callable[[Any], int] | None = None,
        on_parent_failure: ParentPolicy = "cancel",
    ) -> JobType:
        if not NAME.match(name) or len(name) > MAX_NAME:
            raise ValueError(
                f"invalid job type name {name!r}: use lowercase letters, digits, '_' and '.', "
                f"starting with a letter, at most {MAX_NAME} characters"
            )
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"job type {name!r}: {fn.__qualname__} must be an async function")
        params = list(inspect.signature(fn).parameters.values())
        if len(params) != 2:
            raise TypeError(
                f"job type {name!r}: {fn.__qualname__} must take (ctx, payload), "
                f"it takes {len(params)} parameter(s)"
            )
        annotations = inspect.get_annotations(fn)
        return cls(
            name=name,
            fn=fn,
            payload=TypeAdapter(_resolve(annotations.get(params[1].name, Any), fn)),
            result=TypeAdapter(_resolve(annotations.get("return", Any), fn)),
            fallback=fallback,
            exhausted_message=exhausted_message,
            cost=cost,
            on_parent_failure=on_parent_failure,
        )

    @classmethod
    def external(cls, name: str) -> JobType:
        """A type run by external workers over the API (``external = true`` in the retry
        config): any JSON payload and result, and no function in this process."""
        anything = TypeAdapter(Any)
        return cls(name=name, fn=_runs_elsewhere, payload=anything, result=anything)

    @property
    def is_external(self) -> bool:
        return self.fn is _runs_elsewhere

    @property
    def degradation(self) -> TypeDegradation:
        return TypeDegradation(self.fallback, self.exhausted_message)

    def payload_json(self, payload: Any) -> Any:
        """Validate a payload given at submit and return its JSON form, or raise InvalidPayload
        naming the field at fault (orchestrator.domain.json_values says what JSON cannot hold)."""
        try:
            value = self.payload.validate_python(payload)
            return _json_form(self.payload, value, "payload")
        except ValidationError as exc:
            raise InvalidPayload(self.name, _summary(exc)) from None
        except (TypeError, ValueError) as exc:  # not JSON (NotJson names the field)
            raise InvalidPayload(self.name, str(exc)) from None

    def cost_of(self, payload: Any) -> int:
        """A job's cost, estimated from its (valid, JSON) payload: the type's estimate, or 1."""
        if self.cost is None:
            return 1
        return max(0, int(self.cost(self.parse_payload(payload))))

    def parse_payload(self, stored: Any) -> Any:
        """The typed payload for the task, from its stored JSON (may raise ValidationError)."""
        return self.payload.validate_python(stored)

    def result_json(self, value: Any) -> Any:
        """Validate a task's return value against its annotation and return its JSON form
        (raises ValidationError, or InvalidOutput for what JSON cannot hold)."""
        try:
            return _json_form(self.result, self.result.validate_python(value), "result")
        except json_values.NotJson as exc:
            raise InvalidOutput(str(exc), output=repr(value)[:2_000]) from None


async def _runs_elsewhere(ctx: Any, payload: Any) -> Any:
    """An external type's stand-in: in-process workers never fetch its queue."""
    raise RuntimeError("this job type runs on external workers (docs/api.md)")


def _json_form(adapter: TypeAdapter[Any], value: Any, where: str) -> Any:
    """``value``'s JSON form; NotJson when JSON cannot hold it exactly."""
    try:
        json_values.check(adapter.dump_python(value), where)
    except ValueError as exc:
        if isinstance(exc, json_values.NotJson) or "depth" not in str(exc):
            raise
        raise json_values.NotJson(  # pydantic's own limit, past ours
            f"{where}: nested more than {json_values.MAX_DEPTH} levels deep"
        ) from None
    return adapter.dump_python(value, mode="json")


def _resolve(annotation: Any, fn: JobFunction) -> Any:
    """Evaluate one string annotation; the context's annotation is never needed at runtime."""
    if isinstance(annotation, str):  # postponed annotations (from __future__ import annotations)
        return eval(annotation, getattr(fn, "__globals__", {}))
    return annotation


def _summary(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or "(payload)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)
