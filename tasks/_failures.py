"""Failures no retry can fix, as types, and how their kind crosses a hop as data.

A task that fails with a `Final` error is not retried (`retry_unless_final`, every stage task's retry
condition): training that refused its input (the trainer's exit status 2) fails the same way every time, and
an online side whose partner has been silent for `wait_s` would only wait again. When a pipeline runs a stage
as a flow run of its deployment (a hop), the stage flow ends that run Failed with the error's `kind` as the
state's name (`end_failed`), and the hop raises the same type again from the name (`raise_for`): the kind
travels as a field of the run's state, never as a substring of its message.
"""
from __future__ import annotations

from typing import Any, ClassVar

from prefect.states import Failed, State


class Final(RuntimeError):
    """A failure a retry cannot fix; `kind` names it in a flow run's state."""

    kind: ClassVar[str] = "Final"


class UserInputError(Final):
    """Bad input or config: retrying cannot help."""

    kind = "Refused"


class PartnerGone(Final):
    """One side of the online pair waited its `wait_s` for the other, which showed no sign of life that long. The
    other has ended for good (a retry of it starts within seconds), so a retry of this side would only wait
    again."""

    kind = "PartnerGone"


KINDS: dict[str, type[Final]] = {c.kind: c for c in (UserInputError, PartnerGone)}


def failure(state: State) -> BaseException | None:
    """The exception a finished, failed task or flow state holds (None when it completed)."""
    if state.is_completed():
        return None
    try:
        got: Any = state.result(raise_on_failure=False)
    except Exception as e:  # a result that could not be read back is a failure of its own kind
        return e
    return got if isinstance(got, BaseException) else RuntimeError(state.message or state.name)


def retry_unless_final(task, task_run, state) -> bool:
    """Prefect's retry condition: retry crashes and kills (a rerun resumes), not a `Final` failure."""
    return not isinstance(failure(state), Final)


def end_failed(e: Final) -> State:
    """The state a stage flow returns for a `Final` failure: Failed, named by its kind."""
    return Failed(name=e.kind, message=f"{type(e).__name__}: {e}")


def raise_for(state: State, msg: str) -> None:
    """Raise for a flow run that did not complete: the `Final` type its state's name gives, else RuntimeError."""
    raise KINDS.get(state.name, RuntimeError)(msg)
