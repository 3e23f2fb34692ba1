"""`gpuhook simulate DIR`: a complete fake NVIDIA GPU host under one directory.

The GPU is the only fake in gpuhook's tests and demo; everything around it is real:

    DIR/driver/   driver root: real ELF libraries per capability (built with the system C
                  compiler, NVIDIA's sonames and versioned file names), an ld cache made by
                  the host's ldconfig, static binaries (nvidia-smi, ...), GSP firmware, the
                  persistenced socket
    DIR/dev/      device nodes with NVIDIA's numbers (major 195; nvidia-uvm on a free major)
    DIR/proc/     devices, driver/nvidia/{version,params,registry}, one
                  driver/nvidia/gpus/<bus>/information per GPU
    DIR/config.toml   points gpuhook at all of the above
    DIR/host.json     what was built (GPUs, UUIDs, majors), for tests and tools

Opening a simulated node in a container gives ENXIO when the device cgroup allows it (no
driver behind the number) and EPERM when it does not: the observable difference tests use.
"""

import json
import os
import shutil
import socket
import stat
import subprocess
import uuid as uuidlib

from gpuhook.discover import LIBRARIES, MULTIARCH
from gpuhook.errors import GpuhookError

NVIDIA_MAJOR = 195
DEFAULT_DRIVER_VERSION = "550.54.15"
DEFAULT_MODEL = "NVIDIA H100 80GB HBM3"
MARKER = "host.json"
CSRC = os.path.join(os.path.dirname(__file__), "csrc")

# Sonames as NVIDIA ships them: "1"-style ABI versions, or the full driver version ("V").
SONAME_SUFFIX = {
    "libnvidia-ml": "1", "libnvidia-cfg": "1", "libnvidia-nscq": "2",
    "libcuda": "1", "libcudadebugger": "1", "libnvidia-opencl": "1", "libnvidia-ptxjitcompiler": "1",
    "libnvidia-nvvm": "4", "libnvidia-allocator": "1", "libnvidia-gpucomp": "V",
    "libnvidia-pkcs11": "V", "libnvidia-pkcs11-openssl3": "V",
    "libnvcuvid": "1", "libnvidia-encode": "1", "libnvidia-opticalflow": "1", "libvdpau_nvidia": "1",
    "libnvidia-eglcore": "V", "libnvidia-glcore": "V", "libnvidia-tls": "V", "libnvidia-glsi": "V",
    "libnvidia-fbc": "1", "libnvidia-rtcore": "V", "libnvoptix": "1", "libGLX_nvidia": "0",
    "libEGL_nvidia": "0", "libGLESv2_nvidia": "2", "libGLESv1_CM_nvidia": "1",
    "libnvidia-glvkspirv": "V", "libnvidia-ngx": "1",
}
TOOLS = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
         "nvidia-cuda-mps-server")
BUILD_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


class SimulationError(GpuhookError):
    exit_code = 2


def _run(argv, what):
    try:
        subprocess.run(argv, env=BUILD_ENV, check=True, capture_output=True, timeout=120, cwd="/")
    except FileNotFoundError:
        raise SimulationError(f"{what}: {argv[0]} is not installed") from None
    except subprocess.CalledProcessError as err:
        tail = err.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise SimulationError(f"{what} failed: {tail[0]}") from None


def free_major(taken_text: str, avoid=()) -> int:
    """A character major the running kernel does not use, from the dynamic range's top."""
    taken = set(avoid)
    for line in taken_text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0].isdigit():
            taken.add(int(fields[0]))
    for major in range(511, 383, -1):
        if major not in taken:
            return major
    raise SimulationError("no free character device major for the simulated nvidia-uvm")


def gpu_records(count: int, seed: str, model: str) -> list[dict]:
    gpus = []
    for i in range(count):
        bus = f"00000000:{0x18 + 0x10 * (i % 14) + i // 14:02x}:00.0"
        gpus.append({
            "index": i,
            "minor": i,
            "uuid": "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"gpuhook-sim/{seed}/{i}")),
            "bus_id": bus[4:].lower(),
            "model": model,
        })
    return gpus


def _information(gpu: dict) -> str:
    return (
        f"Model: \t\t {gpu['model']}\n"
        f"IRQ:   \t\t {100 + gpu['index']}\n"
        f"GPU UUID: \t {gpu['uuid']}\n"
        f"Video BIOS: \t 96.00.61.00.01\n"
        f"Bus Type: \t PCIe\n"
        f"DMA Size: \t 52 bits\n"
        f"DMA Mask: \t 0xfffffffffffff\n"
        f"Bus Location: \t {gpu['bus_id']}\n"
        f"Device Minor: \t {gpu['minor']}\n"
        f"GPU Excluded:\t No\n"
    )


PARAMS = """ResmanDebugLevel: 4294967295
RmLogonRC: 1
ModifyDeviceFiles: 1
DeviceFileUID: 0
DeviceFileGID: 0
DeviceFileMode: 438
InitializeSystemMemoryAllocations: 1
UsePageAttributeTable: 4294967295
EnableMSI: 1
EnablePCIeGen3: 0
MemoryPoolSize: 0
KMallocHeapMaxSize: 0
VMallocHeapMaxSize: 0
IgnoreMMIOCheck: 0
EnableStreamMemOPs: 0
EnableUserNUMAManagement: 1
NvLinkDisable: 0
RmProfilingAdminOnly: 1
PreserveVideoMemoryAllocations: 0
"""


def _write(path: str, text: str, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def build(directory: str, gpus: int = 2, driver_version: str = DEFAULT_DRIVER_VERSION,
          model: str = DEFAULT_MODEL, seed: str = "default", machine: str | None = None) -> dict:
    """Create the simulated host under `directory` (replacing an earlier one there)."""
    if os.geteuid() != 0:
        raise SimulationError("simulate needs root: it creates device nodes and runs ldconfig -r")
    if not 1 <= gpus <= 64:
        raise SimulationError(f"--gpus must be between 1 and 64, not {gpus}")
    parts = driver_version.split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts):
        raise SimulationError(f"--driver-version must look like 550.54.15, not {driver_version!r}")
    machine = machine or os.uname().machine
    multiarch = MULTIARCH.get(machine)
    if multiarch is None:
        raise SimulationError(f"unsupported machine {machine}")
    directory = os.path.abspath(directory)
    if os.path.exists(directory) and os.listdir(directory):
        if not os.path.exists(os.path.join(directory, MARKER)):
            raise SimulationError(f"{directory} is not empty and is not a simulated host; refusing to replace it")
        shutil.rmtree(directory)
    os.makedirs(directory, exist_ok=True)

    driver = f"{directory}/driver"
    libdir = f"{driver}/usr/lib/{multiarch}"
    os.makedirs(libdir)
    _build_libraries(libdir, driver_version)
    _write(f"{driver}/etc/ld.so.conf", f"/usr/lib/{multiarch}\n")
    _run(["ldconfig", "-r", driver], "ldconfig for the simulated driver root")
    _build_tools(f"{driver}/usr/bin", driver_version)
    firmware = f"{driver}/lib/firmware/nvidia/{driver_version}"
    os.makedirs(firmware)
    for name in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        with open(f"{firmware}/{name}", "wb") as f:
            f.write(b"GSPSIM" + os.urandom(4090))
    _make_socket(f"{driver}/var/run/nvidia-persistenced/socket")

    with open("/proc/devices") as f:
        real_devices = f.read()
    uvm_major = free_major(real_devices, avoid=(NVIDIA_MAJOR,))
    caps_major = free_major(real_devices, avoid=(NVIDIA_MAJOR, uvm_major))
    records = gpu_records(gpus, seed, model)
    proc = f"{directory}/proc"
    _write(f"{proc}/devices",
           "Character devices:\n  1 mem\n  5 /dev/tty\n136 pts\n"
           f"{NVIDIA_MAJOR} nvidia-frontend\n{uvm_major} nvidia-uvm\n{caps_major} nvidia-caps\n"
           "\nBlock devices:\n  7 loop\n")
    _write(f"{proc}/driver/nvidia/version",
           f"NVRM version: NVIDIA UNIX {machine} Kernel Module  {driver_version}  "
           f"(simulated by gpuhook)\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    _write(f"{proc}/driver/nvidia/params", PARAMS)
    _write(f"{proc}/driver/nvidia/registry", "Binary: \"\"\n")
    for gpu in records:
        _write(f"{proc}/driver/nvidia/gpus/{gpu['bus_id']}/information", _information(gpu))

    dev = f"{directory}/dev"
    os.makedirs(dev)
    nodes = [("nvidiactl", NVIDIA_MAJOR, 255), ("nvidia-modeset", NVIDIA_MAJOR, 254),
             ("nvidia-uvm", uvm_major, 0), ("nvidia-uvm-tools", uvm_major, 1)]
    nodes += [(f"nvidia{g['minor']}", NVIDIA_MAJOR, g["minor"]) for g in records]
    old_umask = os.umask(0)
    try:
        for name, major, minor in nodes:
            os.mknod(f"{dev}/{name}", stat.S_IFCHR | 0o666, os.makedev(major, minor))
    finally:
        os.umask(old_umask)

    config_text = (
        "# Written by `gpuhook simulate`: points gpuhook at the simulated host in this directory.\n"
        f'driver-root = "{driver}"\n'
        f'dev-root = "{dev}"\n'
        f'proc-root = "{proc}"\n'
        f'log-file = "{directory}/gpuhook.log"\n'
        f'state-dir = "{directory}/run"\n'
    )
    _write(f"{directory}/config.toml", config_text)
    host = {
        "directory": directory,
        "driver_version": driver_version,
        "machine": machine,
        "majors": {"nvidia": NVIDIA_MAJOR, "nvidia-uvm": uvm_major, "nvidia-caps": caps_major},
        "gpus": records,
        "config": f"{directory}/config.toml",
    }
    _write(f"{directory}/{MARKER}", json.dumps(host, indent=2) + "\n")
    return host


def _build_libraries(libdir: str, version: str) -> None:
    for stems in LIBRARIES.values():
        for stem in stems:
            suffix = SONAME_SUFFIX[stem]
            soname = f"{stem}.so.{version if suffix == 'V' else suffix}"
            _run(["gcc", "-shared", "-fPIC", "-O1", "-o", f"{libdir}/{stem}.so.{version}",
                  f"-Wl,-soname,{soname}", f'-DSIM_LIBRARY="{stem}"', f'-DSIM_DRIVER_VERSION="{version}"',
                  f"{CSRC}/driverlib.c"], f"building {stem}")


def _build_tools(bindir: str, version: str) -> None:
    os.makedirs(bindir)
    first = f"{bindir}/{TOOLS[0]}"
    _run(["gcc", "-static", "-O2", "-s", "-o", first, f'-DSIM_DRIVER_VERSION="{version}"', f"{CSRC}/tool.c"],
         "building the simulated nvidia-smi")
    for name in TOOLS[1:]:
        shutil.copy2(first, f"{bindir}/{name}")


def _make_socket(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    finally:
        sock.close()
