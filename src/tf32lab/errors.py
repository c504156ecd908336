"""The one exception tf32lab raises for its own reasons."""


class Tf32LabError(ValueError, RuntimeError):
    """Raised by tf32lab when a request cannot be honoured; the message names the value and the fix.

    A ``ValueError`` (a bad value: a level, a target, a tolerance) and, as before, a ``RuntimeError``: code that
    caught either keeps working.
    """
