"""What the device tests run against: the real NVIDIA driver of this host, or (to debug the
tests and tests/device/run-on-device.sh on a machine without a GPU) a simulated host.

Environment (all optional; tests/device/README.md):

    GPUHOOK_DEVICE_CONFIG     a gpuhook config for this host (driver-root, nvml-library,
                              ldconfig, ...); default: one written here for driver-root "/"
    GPUHOOK_DEVICE_RUNC       the runc binary (default: runc on PATH)
    GPUHOOK_DEVICE_BUSYBOX    a static busybox (default: /bin/busybox or /usr/bin/busybox)
    GPUHOOK_DEVICE_CUDATEST   a built tests/device/cudatest.c (default: built here with gcc)
    GPUHOOK_DEVICE_SIMULATED  a `gpuhook simulate` directory to run against instead of a GPU
    GPUHOOK_DEVICE_FIGURES    where the latency test writes its figures (JSON)
    GPUHOOK_DEVICE_RESET=1    allow the tests that reset a GPU

Where there is no NVIDIA kernel module (no /proc/driver/nvidia/version) and nothing is
simulated, every device test skips. Where there is one, anything missing or wrong fails:
a GPU host is where these tests must say something.
"""

import json
import os
import shutil
import subprocess

import pytest

PROC_VERSION = "/proc/driver/nvidia/version"
HERE = os.path.dirname(os.path.abspath(__file__))

# The reset command of every config written here: a program that does not exist, so a reset
# is never even prepared (persistence mode is left alone too: gpuhook.health.actions.reset_gpu).
REFUSING_RESET = "/nonexistent/gpuhook-device-tests-never-reset -i {uuid}"


def simulated() -> str | None:
    return os.environ.get("GPUHOOK_DEVICE_SIMULATED") or None


def require_driver() -> None:
    """Skip where this host has no NVIDIA driver and nothing is simulated."""
    if simulated() is None and not os.path.exists(PROC_VERSION):
        pytest.skip(f"no NVIDIA driver: {PROC_VERSION} does not exist (the kernel module is not loaded)")


def needed(value, what: str):
    """`value`, or a test failure naming what is missing (never a skip on a GPU host)."""
    if not value:
        pytest.fail(f"the device tests need {what} (tests/device/README.md)")
    return value


def config_path(workdir: str) -> str:
    """GPUHOOK_DEVICE_CONFIG, or a config written into `workdir`: the simulated host's or
    driver-root "/", private state and log, and a reset command that refuses."""
    given = os.environ.get("GPUHOOK_DEVICE_CONFIG")
    if given:
        return needed(os.path.exists(given) and given, f"the config {given}")
    values = {"state-dir": f"{workdir}/run", "log-file": f"{workdir}/gpuhook.log"}
    sim = simulated()
    if sim is not None:
        with open(f"{sim}/host.json") as f:
            host = json.load(f)
        values.update({"driver-root": f"{sim}/driver", "dev-root": f"{sim}/dev", "proc-root": f"{sim}/proc",
                       "sys-root": f"{sim}/sys", "nvml-library": host["nvml_library"]})
    elif os.path.exists("/sbin/ldconfig.real"):
        values["ldconfig"] = "/sbin/ldconfig.real"  # Ubuntu's /sbin/ldconfig is a shell script
    lines = [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    lines += ["[health]", f"reset-command = {json.dumps(REFUSING_RESET)}", "kill-orphans = false"]
    os.makedirs(workdir, exist_ok=True)
    path = f"{workdir}/config.toml"
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def runc() -> str:
    return needed(os.environ.get("GPUHOOK_DEVICE_RUNC") or shutil.which("runc"), "runc (GPUHOOK_DEVICE_RUNC)")


def busybox() -> str:
    from gpuhook.simulate.demo import RuncError as TestbedError, find_busybox

    given = os.environ.get("GPUHOOK_DEVICE_BUSYBOX")
    if given:
        return needed(os.path.exists(given) and given, f"a static busybox at {given}")
    try:
        return find_busybox()
    except TestbedError:
        return needed(None, "a static busybox (GPUHOOK_DEVICE_BUSYBOX)")


def cudatest(workdir: str) -> str:
    """The CUDA driver-API probe (tests/device/cudatest.c), given or built here."""
    given = os.environ.get("GPUHOOK_DEVICE_CUDATEST")
    if given:
        return needed(os.path.exists(given) and given, f"the cudatest binary {given}")
    gcc = needed(shutil.which("gcc"), "gcc to build tests/device/cudatest.c (or GPUHOOK_DEVICE_CUDATEST)")
    out = f"{workdir}/cudatest"
    subprocess.run([gcc, "-O2", "-o", out, f"{HERE}/cudatest.c", "-ldl"], check=True, timeout=120)
    return out


def glibc_files(binary: str) -> list:
    """The host's C library files `binary` needs, and those libcuda needs besides (libm,
    librt, libpthread, libdl): for a container image made of busybox and the probe."""
    done = subprocess.run(["ldd", binary], capture_output=True, text=True, timeout=30)
    needed(done.returncode == 0, f"ldd to list what {binary} needs")
    found = []
    for line in done.stdout.splitlines():
        for word in line.split():
            if word.startswith("/") and os.path.exists(word):
                found.append(word)
    libc = next((f for f in found if os.path.basename(f) == "libc.so.6"), None)
    libdir = os.path.dirname(needed(libc, "the host's libc.so.6"))
    for name in ("libm.so.6", "librt.so.1", "libpthread.so.0", "libdl.so.2"):
        if os.path.exists(f"{libdir}/{name}"):
            found.append(f"{libdir}/{name}")
    return list(dict.fromkeys(found))
