"""The one error tree of gpuhook.

Every failure the hook or the CLI reports is a `GpuhookError`. Lower layers raise the
specific subclass (translating OS errors once, with ``raise ... from err``); the two
boundaries (the hook entry and the CLI) print ``gpuhook: <message>`` as one line on stderr
and exit with the class's code. A runtime shows that line in its "error running hook"
message, so the message must stand on its own.
"""


# The one exit-code table: README's list, `gpuhook --help` and the man page are made from it
# or checked against it (tests/unit/test_errors.py). Each code's class below sets `exit_code`.
EXIT_CODES = {
    0: "success, or a container that asks for no GPU",
    1: "aborted, or another gpuhook error",
    2: "bad input or configuration",
    3: "a request this host cannot serve",
    4: "a host problem (driver, /proc, cgroups, vanished container, an OS error)",
    5: "a failed apply step (named)",
    6: "a GPU failed its checks",
    7: "the hook's own deadline passed",
    70: "an internal error (details in the log)",
}
INTERNAL_ERROR = 70


def exit_code_text() -> str:
    """The table as one paragraph, for --help and the man page."""
    return "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items()) + "."


class GpuhookError(Exception):
    """Base class. `message` is the one-line text; `hint` is an optional remedy; `detail`
    is text for gpuhook's log only, never shown to the container's user (it may quote files
    the image chose, such as ldconfig's warnings)."""

    exit_code = 1
    detail = None

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        text = self.message if not self.hint else f"{self.message} ({self.hint})"
        # A runtime shows our stderr inline; never let input smuggle extra lines into it.
        return printable(" ".join(text.split()))


def printable(text: str) -> str:
    """`text` with every control or format character (newlines, terminal escapes, bidi
    overrides) replaced by '?': names from a pod spec or an image must not forge report
    lines or drive the operator's terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else "?" for c in text)


class InputError(GpuhookError):
    """The OCI state, the bundle or its config.json is unusable."""

    exit_code = 2


class ConfigError(GpuhookError):
    """gpuhook's own configuration file is missing a value, has a bad one, or an unknown key."""

    exit_code = 2


class RequestError(GpuhookError):
    """The container asked for something this host cannot give (missing GPU, bad capability)."""

    exit_code = 3


class RequirementError(RequestError):
    """The image's NVIDIA_REQUIRE_* constraints are malformed or this host does not meet them.

    `variable` names the environment variable, `constraint` the condition that failed (or is
    malformed), `host` what the host has, as text.
    """

    def __init__(self, message: str, hint: str | None = None, variable: str = "", constraint: str = "",
                 host: str = ""):
        super().__init__(message, hint)
        self.variable = variable
        self.constraint = constraint
        self.host = host


class HostError(GpuhookError):
    """The host (driver files, /proc, cgroups, NVML) could not be read as needed."""

    exit_code = 4


def from_os_error(err: OSError) -> HostError:
    """The one translation of an OSError no layer below handled: the file the OS names, and
    its reason, as a host error (exit 4). Like psutil's wrap_exceptions, in one place."""
    where = f"{err.filename}: " if err.filename else ""
    return HostError(f"{where}{err.strerror or err}")


class NvmlError(HostError):
    """An NVML call failed. `call` names the NVML function, `gpu` the GPU it was about (UUID,
    index or bus id as the caller knew it; None for system calls), `code` NVML's return code
    (None when the library could not even be loaded)."""

    def __init__(self, call: str, reason: str, gpu: str | None = None, code: int | None = None,
                 hint: str | None = None):
        where = f" for GPU {gpu}" if gpu is not None else ""
        super().__init__(f"NVML {call}{where} failed: {reason}", hint)
        self.call = call
        self.reason = reason
        self.gpu = gpu
        self.code = code


class ApplyError(GpuhookError):
    """A step that changes the container failed; `step` names it."""

    exit_code = 5

    def __init__(self, step: str, message: str, hint: str | None = None):
        super().__init__(f"{step}: {message}", hint)
        self.step = step


class HealthError(GpuhookError):
    """A GPU failed its pre-start checks and could not be repaired."""

    exit_code = 6


class GpuUnhealthyError(HealthError):
    """A GPU is still unhealthy after repair: `gpu` (UUID), `check` (gpuhook.health.checks
    name) and `evidence` say which and why; `report` is the whole health report."""

    def __init__(self, message: str, gpu: str, check: str, evidence: str, report=None, hint: str | None = None):
        super().__init__(message, hint)
        self.gpu = gpu
        self.check = check
        self.evidence = evidence
        self.report = report


class DeadlineError(GpuhookError):
    """The hook ran out of its own time budget; the message names what was cut off."""

    exit_code = 7


class HealthDeadlineError(DeadlineError):
    """The health checks ran out of their deadline: `gpu` and `step` name the first GPU that
    was cut off and what it was doing; `report` holds what did finish."""

    def __init__(self, message: str, gpu: str, step: str, report=None, hint: str | None = None):
        super().__init__(message, hint)
        self.gpu = gpu
        self.step = step
        self.report = report
