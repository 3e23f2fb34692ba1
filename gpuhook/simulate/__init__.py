"""Simulated NVIDIA GPU hosts for tests, the demo and users without a GPU."""
