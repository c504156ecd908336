"""The one exception tf32lab raises for its own reasons."""


class Tf32LabError(RuntimeError):
    """Raised by tf32lab when a request cannot be honoured; the message names the value and the fix."""
