"""Exceptions raised by rtp.

Every user-facing error derives from :class:`RtpError`. Errors caused by bad
user input also derive from :class:`ValueError`, so callers that only know the
standard library can still catch them.
"""


class RtpError(Exception):
    """Base class of every error rtp raises on purpose."""


class ConfigError(RtpError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""


class ModelShapeError(RtpError, ValueError):
    """The model's shape cannot be split over the requested tensor-parallel size."""


class CheckpointError(RtpError):
    """A checkpoint is missing a tensor, has an unexpected one, or a wrong shape."""


class RequestError(RtpError, ValueError):
    """A request can never be served (bad sampling parameters, prompt too long, ...)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        """The request field at fault where the message's own words do not name it (an HTTP error's param)."""


class WorkerDiedError(RtpError):
    """A rank exited, stopped responding, or lost its launcher; the runtime cannot continue."""


class StepTimeoutError(WorkerDiedError):
    """A step did not finish within ``step_timeout_s`` on some rank; the runtime cannot continue."""
