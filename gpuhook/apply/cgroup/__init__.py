"""Device cgroup access for a container: cgroup v1 devices.allow or v2 device programs."""
