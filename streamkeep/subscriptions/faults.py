"""What went wrong in the background, told once per cause and counted for `/stats`, and the backoff
between retries.

Background work (the drivers, webhook deliveries, saves) must never end the server: a failure is
caught where it happens, the work is retried with backoff, and the log hears about a cause once,
when it first appears, and once more when it is gone, not at every retry of every subscription.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from streamkeep.background import Backoff
from streamkeep.health import Causes
from streamkeep.protocol.errors import ProtocolError
from streamkeep.storage.errors import as_protocol_error, from_os_error
from streamkeep.subscriptions.state import Subscription

log = logging.getLogger("streamkeep.subscriptions")

# Retries of a subscription's background work and of its receiver: 1 s doubling to 60 s. The
# counts live on the subscription (`fault_count`, `attempts`), so only the bounds are kept here.
RETRY = Backoff()


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
        self._saves: Causes[str, int | None] = Causes()  # "save" -> the errno saving fails with
        self.task_failures = 0
        self._tasks: Causes[tuple[str, str], Cause] = Causes()  # (subscription, where) -> cause
        self.last_error: dict | None = None

    @property
    def saves_failing(self) -> bool:
        return "save" in self._saves.current

    # ---- saving state ----------------------------------------------------------------------

    def save_failed(self, error: OSError) -> SaveFailed:
        """Counts a failed save, logs its cause once; returns what to raise."""
        self.save_failures += 1
        if self._saves.failed("save", error.errno):
            log.error(
                "subscriptions: cannot save state: %s. Changes are refused (507/503) and background "
                "work retries with backoff; further failures with this cause are counted in /stats",
                error,
            )
        answer = save_failed(error)
        self._note(answer.message)
        return answer

    def save_ok(self) -> None:
        if self._saves.cleared("save") is not None:
            log.warning("subscriptions: saving works again (%d saves failed)", self.save_failures)

    # ---- background tasks ------------------------------------------------------------------

    def failed(self, sub: Subscription, where: str, error: Exception) -> None:
        """A background task of `sub` failed at `where`; the caller retries with backoff."""
        self.task_failures += 1
        self._note(f"subscription {sub.id}: {where}: {error!r}")
        if isinstance(error, SaveFailed) or sub.deleted:
            return  # told once by save_failed; a deleted subscription retries nothing
        cause = cause_of(where, error)
        key = (sub.id, where)
        previous = self._tasks.current.get(key)
        if previous == cause:
            return
        if previous is not None:
            self._over(self._tasks.cleared(key))
        if self._tasks.failed(key, cause):
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

    def succeeded(self, sub: Subscription, where: str) -> None:
        self._over(self._tasks.cleared((sub.id, where)))

    def forget(self, sub: Subscription) -> None:
        for key in [key for key in self._tasks.current if key[0] == sub.id]:
            self._tasks.cleared(key)  # quietly: it is gone, not working again

    @staticmethod
    def _over(told: tuple[Cause] | None) -> None:
        if told is not None:
            (cause,) = told
            log.info("subscriptions: %s works again (it failed with %s)", cause[0], " ".join(cause[1:]))

    def _note(self, message: str) -> None:
        at = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        self.last_error = {"message": message[:500], "at": at}
