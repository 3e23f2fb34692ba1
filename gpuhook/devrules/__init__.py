"""The device rule model, pure: rules as runc and the kernel's devices.list write them
(`devices.py`) and the cgroup v2 device programs that enforce them, built and decoded
without a kernel (`program.py`). What changes a real cgroup lives in gpuhook.apply.cgroup."""
