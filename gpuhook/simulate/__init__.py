"""Simulated NVIDIA GPU hosts for tests, the demo and users without a GPU."""

from gpuhook.errors import InputError


class SimulationError(InputError):
    """A simulated host or its NVML state could not be built, read or changed."""
