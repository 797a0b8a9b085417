"""What a conformance run reports: a StepResult per step, each PASS, FAIL or SKIP; and
_StepFailed, how a step says the worker is wrong."""

from __future__ import annotations

import dataclasses

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclasses.dataclass
class StepResult:
    """One line of the report: ``status`` is PASS, FAIL or SKIP; ``detail`` says what was
    expected and what came; ``notes`` are things a PASS still wants the author to know."""

    step: str
    status: str
    detail: str
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class _StepFailed(Exception):
    """A step found the worker wrong; the message is the report's detail."""
