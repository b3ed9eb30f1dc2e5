"""The suite's own errors: what it raises when it cannot run, as opposed to a backend's failure."""


class SetupError(Exception):
    """The suite cannot run as asked; the message says what to change (exit status 2)."""


class SpecSideBug(SetupError):
    """The spec's own state broke an invariant the suite checks (its block manager, pool or
    ground truth): a bug in spec/ or in the suite, never the backend's failure (exit status 2).

    >>> str(SpecSideBug("block 3 is free but has a hash"))
    'a bug in spec/ or in the suite, not the backend: block 3 is free but has a hash'
    """

    BLAME = "a bug in spec/ or in the suite, not the backend"

    def __init__(self, detail: str) -> None:
        super().__init__(f"{self.BLAME}: {detail}")


class SuiteStopped(KeyboardInterrupt):
    """Carries a :class:`SetupError` raised inside an example out of Hypothesis, untouched.

    A ``KeyboardInterrupt`` because that is the one exception Hypothesis lets
    through without replaying the example: a setup error met mid-run (the
    suite's reference out of memory) is not the backend's failure, and a
    replay that stops elsewhere would be reported as an unreliable run.
    """

    def __init__(self, error: SetupError) -> None:
        super().__init__(str(error))
        self.error = error
