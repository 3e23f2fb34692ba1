"""Simulated NVIDIA GPU hosts for tests, the demo and users without a GPU."""

from gpuhook.errors import GpuhookError


class SimulationError(GpuhookError):
    """A simulated host or its NVML state could not be built, read or changed."""

    exit_code = 2
