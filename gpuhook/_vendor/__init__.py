"""Third-party modules the distribution packages ship privately.

Empty in the source tree: packaging/build-deb and packaging/build-rpm install
packaging/vendor/nvidia-ml-py/pynvml.py here, because Debian has no nvidia-ml-py package.
pip installs get ``pynvml`` from nvidia-ml-py instead, and gpuhook imports this copy only
when no ``pynvml`` is importable.
"""
