"""The suite's own errors: what it raises when it cannot run, as opposed to a backend's failure."""


class SetupError(Exception):
    """The suite cannot run as asked; the message says what to change (exit status 2)."""
