"""Docker's `--gpus`: only what dockerd asked for, and a poststop dockerd never registers.

gpuhook runs under Docker through the launcher `gpuhook install docker` writes, which names
dockerd's data root in GPUHOOK_DOCKER_DATA_ROOT (docs/docker.md). Two things follow:

- **The request is the daemon's.** dockerd (moby daemon/nvidia_linux.go, `setNvidiaGPUs`;
  `injectNVIDIARuntimeHook` in later releases) appends NVIDIA_VISIBLE_DEVICES after the
  image's environment for a device request of the nvidia driver: the device ids joined, a
  count N as `0,...,N-1`, a count of -1 (`--gpus all`) as `all`, and nothing at all for a
  count of 0 (`--gpus 0`, `count=0`), while 20.10 still registers the hook. The environment
  alone cannot tell the daemon's value from the image's, so the request is read from the
  container's own hostconfig.json (`DeviceRequests`), which dockerd writes root-only under
  `<data-root>/containers/<id>/`; the container gets exactly what the daemon appended, and
  nothing when it appended nothing, whatever the image says (no legacy-image rule either).
- **A poststop through the launcher.** dockerd registers only a prestart hook, so after a
  start gpuhook.apply.dockerwait leaves a small waiter that runs gpuhook's poststop once the
  container's init has exited.
"""

import os

ENV_DATA_ROOT = "GPUHOOK_DOCKER_DATA_ROOT"
# The capabilities dockerd's nvidia driver answers to (moby daemon/nvidia_linux.go): a device
# request without a driver name goes to it when one of its capability lists is within these.
NVIDIA_CAPABILITIES = frozenset(("gpu", "nvidia", "compute", "compat32", "graphics", "utility", "video", "display"))
MAX_HOSTCONFIG_BYTES = 1 << 20


def _is_nvidia(request: dict) -> bool:
    driver = request.get("Driver") or ""
    if driver:
        return driver == "nvidia"
    lists = request.get("Capabilities") or []
    return any(isinstance(caps, list) and caps and set(caps) <= NVIDIA_CAPABILITIES for caps in lists)


def appended_value(device_requests) -> str | None:
    """The NVIDIA_VISIBLE_DEVICES dockerd appended for these DeviceRequests (the last one
    wins, as in the container's environment), or None when it appended none."""
    value = None
    for request in device_requests or []:
        if not isinstance(request, dict) or not _is_nvidia(request):
            continue
        ids, count = request.get("DeviceIDs") or [], request.get("Count") or 0
        if not isinstance(count, int) or not isinstance(ids, list):
            continue
        if ids:
            value = ",".join(str(i) for i in ids)
        elif count > 0:
            value = ",".join(str(i) for i in range(count))
        elif count < 0:
            value = "all"
    return value


def hostconfig_path(data_root: str, container_id: str) -> str:
    return f"{data_root}/containers/{container_id}/hostconfig.json"


def daemon_request(spec, container_id: str, data_root: str):
    """`spec` whose NVIDIA_VISIBLE_DEVICES is exactly what dockerd appended for this container
    (`void` when it appended none). Raises InputError when the daemon's record cannot be
    read: never a guess from the image's environment."""
    import json

    from gpuhook.kernel import files
    from gpuhook.errors import InputError

    if not container_id or "/" in container_id or container_id.startswith("."):
        raise InputError(f"docker: container id {container_id[:80]!r} names no container directory")
    path = hostconfig_path(data_root, container_id)
    try:
        data = files.read_trusted(path, MAX_HOSTCONFIG_BYTES + 1)
        directory = os.lstat(os.path.dirname(path))
        if not files.trusted(directory):
            raise files.UntrustedPath(1, "not owned by root and writable only by it", path)
        if len(data) > MAX_HOSTCONFIG_BYTES:
            raise ValueError("larger than 1 MiB")
        doc = json.loads(data)
    except (OSError, ValueError) as err:
        why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise InputError(f"docker: cannot read dockerd's record of the container's --gpus request ({path}: {why})",
                         f"{ENV_DATA_ROOT} in the launcher must be dockerd's data-root: "
                         "gpuhook install docker --data-root DIR") from None
    requests = doc.get("DeviceRequests") if isinstance(doc, dict) else None
    value = appended_value(requests if isinstance(requests, list) else [])
    env = dict(spec.env)
    env["NVIDIA_VISIBLE_DEVICES"] = "void" if value is None else value
    return spec._replace(env=env)
