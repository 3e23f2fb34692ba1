"""The system's interfaces, thin and policy-free: system calls (linux), /proc and the mount
table, processes, files. A leaf: it imports nothing of gpuhook but errors and record
(tests/unit/test_architecture.py)."""
