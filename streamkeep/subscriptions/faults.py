"""What went wrong in the background, told once per cause and counted for `/stats`, and the backoff
between retries.

Background work (the drivers, webhook deliveries, saves) must never end the server: a failure is
caught where it happens, the work is retried with backoff, and the log hears about a cause once,
when it first appears, and once more when it is gone, not at every retry of every subscription.
"""

from __future__ import annotations

import logging
import random
from datetime import UTC, datetime

from streamkeep.protocol.errors import ProtocolError
from streamkeep.storage.errors import as_protocol_error, from_os_error
from streamkeep.subscriptions.state import Subscription

log = logging.getLogger("streamkeep.subscriptions")

RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0
RETRY_JITTER = 0.2


def backoff(attempt: int) -> float:
    """Seconds before retry `attempt` (1, 2, ...): 1 s doubling up to 60 s, with 20% jitter."""
    delay = min(RETRY_MAX_S, RETRY_MIN_S * 2 ** min(attempt - 1, 16))
    return delay * (1 + random.uniform(-RETRY_JITTER, RETRY_JITTER))


Cause = tuple[str, ...]


class SaveFailed(ProtocolError):
    """Subscription state could not be saved; the change it carried was not applied."""


def save_failed(error: OSError) -> SaveFailed:
    """The answer for a failed save: the one the server gives for any storage trouble."""
    answer = as_protocol_error(from_os_error(error, "cannot save subscription state"), "")
    return SaveFailed(answer.status, answer.code, answer.message, answer.headers)


def cause_of(where: str, error: BaseException) -> Cause:
    """What makes two failures the same: where, what kind, and where it was raised."""
    if isinstance(error, ProtocolError):
        return (where, "protocol", error.code)
    if isinstance(error, OSError):
        return (where, "os", str(error.errno))
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    site = "" if frame is None else f"{frame.tb_frame.f_code.co_filename}:{frame.tb_lineno}"
    return (where, type(error).__qualname__, site)


class Faults:
    def __init__(self) -> None:
        self.save_failures = 0
        self.saves_failing = False
        self._save_cause: int | None = None
        self.task_failures = 0
        self._failing: dict[Cause, set[str]] = {}  # cause -> the subscriptions failing with it
        self._cause: dict[tuple[str, str], Cause] = {}  # (subscription, where) -> its cause
        self.last_error: dict | None = None

    # ---- saving state ----------------------------------------------------------------------

    def save_failed(self, error: OSError) -> SaveFailed:
        """Counts a failed save, logs its cause once; returns what to raise."""
        self.save_failures += 1
        self.saves_failing = True
        if error.errno != self._save_cause:
            self._save_cause = error.errno
            log.error(
                "subscriptions: cannot save state: %s. Changes are refused (507/503) and background "
                "work retries with backoff; further failures with this cause are counted in /stats",
                error,
            )
        answer = save_failed(error)
        self._note(answer.message)
        return answer

    def save_ok(self) -> None:
        if self.saves_failing:
            self.saves_failing = False
            self._save_cause = None
            log.warning("subscriptions: saving works again (%d saves failed)", self.save_failures)

    # ---- background tasks ------------------------------------------------------------------

    def failed(self, sub: Subscription, where: str, error: Exception) -> None:
        """A background task of `sub` failed at `where`; the caller retries with backoff."""
        self.task_failures += 1
        self._note(f"subscription {sub.id}: {where}: {error!r}")
        if isinstance(error, SaveFailed) or sub.deleted:
            return  # told once by save_failed; a deleted subscription retries nothing
        cause = cause_of(where, error)
        previous = self._cause.get((sub.id, where))
        if previous == cause:
            return
        if previous is not None:
            self._drop(sub.id, previous)
        self._cause[(sub.id, where)] = cause
        failing = self._failing.setdefault(cause, set())
        if not failing:
            if isinstance(error, ProtocolError | OSError):
                log.warning("subscription %s: %s failed: %s; retrying with backoff", sub.id, where, error)
            else:  # a bug: the traceback is what helps
                log.error(
                    "subscription %s: %s failed; retrying with backoff (further failures with this "
                    "cause are counted in /stats)",
                    sub.id,
                    where,
                    exc_info=error,
                )
        failing.add(sub.id)

    def succeeded(self, sub: Subscription, where: str) -> None:
        cause = self._cause.pop((sub.id, where), None)
        if cause is not None:
            self._drop(sub.id, cause)

    def forget(self, sub: Subscription) -> None:
        for key in [key for key in self._cause if key[0] == sub.id]:
            self._drop(sub.id, self._cause.pop(key), quiet=True)

    def _drop(self, sub_id: str, cause: Cause, *, quiet: bool = False) -> None:
        failing = self._failing.get(cause)
        if failing is None:
            return
        failing.discard(sub_id)
        if not failing:
            del self._failing[cause]
            if not quiet:
                log.info("subscriptions: %s works again (it failed with %s)", cause[0], " ".join(cause[1:]))

    def _note(self, message: str) -> None:
        at = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        self.last_error = {"message": message[:500], "at": at}
