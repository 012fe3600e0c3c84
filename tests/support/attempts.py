"""The model of the worker contract's ``max_attempts`` (docs/contracts.md, "Attempts and runs"),
which SQL alone tells in production (functions/claim.sql): tests/test_max_attempts.py drives both
with the same budgets and demands the same answers; tests/test_policy.py proves the model against
every failure the policy can meet."""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from orchestrator.domain.policy import Budget, Layer

#: When a job's ``max_attempts`` is told: at the claim of an attempt (``job.running``), after its
#: failure retried at a layer, or after its terminal failure.
Moment = Layer | Literal["claim", "terminal"]


def max_attempts(attempt: int, budget: Budget, moment: Moment) -> int:
    """The worker contract's ``max_attempts``: the most attempts the job can reach from here if
    every try fails (docs/contracts.md, "Attempts and runs"), so a failure is terminal exactly
    when ``attempt >= max_attempts``, and a terminal failure has ``max_attempts == attempt``.

    At a claim: this attempt, the runs left in its dispatch (a ``TRANSIENT_INFRA`` failure each),
    then a dispatch of ``max_runs`` runs for each application retry left (a ``TRANSIENT_APP``
    failure on a dispatch's last run takes one; an infrastructure failure there is terminal).
    After a retry: the claim it leads to (an infrastructure retry keeps the cap; an application
    retry gives up the runs its dispatch had left). Only what is not a failure raises it (a
    hand-back, an approval, a lost dispatch given anew, a keyed submit replacing a waiting job,
    a producer's reschedule, a pause of its flow key: each gives the job a fresh dispatch).
    The production rule is SQL's (orc_max_attempts_v1 at a claim, orc_max_attempts_after_v1
    after a failure, functions/claim.sql); tests/test_max_attempts.py holds it to this model.
    """
    match moment:
        case "terminal":
            return attempt
        case Layer.INFRA:
            attempt, budget = attempt + 1, replace(budget, run=budget.run + 1)
        case Layer.APP:
            attempt += 1
            budget = replace(budget, run=1, retry_count=budget.retry_count + Layer.APP.retries_used)
        case Layer.PAUSE:
            attempt, budget = attempt + 1, replace(budget, run=1)
    runs_left = max(0, budget.max_runs - budget.run)
    retries_left = max(0, budget.max_retries - budget.retry_count)
    return attempt + runs_left + retries_left * budget.max_runs
