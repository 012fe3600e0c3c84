"""determine(): what follows a terminal failure, over every error class and kind of job type."""

import itertools

import pytest

from orchestrator.domain.classification import ErrorClass
from orchestrator.domain.degradation import Degradation, determine

ESCALATION = "send_notification"
FAILING = [c for c in ErrorClass if c is not ErrorClass.VALID]
OWN = "The tool ran out of retries."


@pytest.mark.parametrize(
    ("error_class", "exhausted_message"), list(itertools.product(FAILING, [None, OWN]))
)
def test_a_type_with_a_fallback_keeps_the_content_and_tells_nobody(
    error_class: ErrorClass, exhausted_message: str | None
) -> None:
    got = determine(
        "deliver", error_class, fallback="log_content", escalation_type=ESCALATION,
        exhausted_message=exhausted_message,
    )  # fmt: skip
    assert (got.fallback, got.notify_human) == ("log_content", False)
    if exhausted_message and error_class is ErrorClass.TRANSIENT_APP:
        assert got.message == OWN
    else:  # no type's name or wording but its own: the class and the fallback
        assert got.message == (
            f"Job failed ({error_class.value}); its fallback (log_content) kept the content."
        )


@pytest.mark.parametrize("error_class", FAILING)
def test_a_failed_escalation_is_not_escalated_again(error_class: ErrorClass) -> None:
    got = determine(ESCALATION, error_class, fallback=None, escalation_type=ESCALATION)
    assert got == Degradation(None, False, "Human notification failed; it is not escalated again.")


@pytest.mark.parametrize(
    ("error_class", "exhausted_message"), list(itertools.product(FAILING, [None, OWN]))
)
def test_any_other_type_notifies_a_person_with_what_happened(
    error_class: ErrorClass, exhausted_message: str | None
) -> None:
    got = determine(
        "summarise", error_class, fallback=None, escalation_type=ESCALATION,
        exhausted_message=exhausted_message,
    )  # fmt: skip
    assert (got.fallback, got.notify_human) == (None, True)
    if exhausted_message and error_class is ErrorClass.TRANSIENT_APP:
        assert got.message == OWN
    elif error_class in (ErrorClass.TRANSIENT_APP, ErrorClass.TRANSIENT_INFRA):
        assert got.message == (
            f"Job failed after exhausting all retries. Last error class: {error_class.value}. "
            "Manual review required."
        )
    else:
        assert got.message == (
            f"Job failed permanently ({error_class.value}). Manual review required."
        )
