"""NVIDIA's conventions, in one place: what every stage knows about the driver without reading it.

The driver capabilities a container can ask for and the libraries, programs, data files and
IPC endpoints each brings (NVIDIA's container toolkit, internal/discover and
internal/config/image/capabilities.go); the directories the driver's programs live in; the
node paths of GPUs and MIG devices; the syntax of GPU UUIDs and MIG ids; the CDI kind
gpuhook writes. Pure data and pure functions, standard library only: the request, discovery,
planning, health and CDI generation read it, and it reads nothing (docs/architecture.md says
why it sits below the stages).
"""

# --- capabilities -------------------------------------------------------------------------

CAPABILITIES = ("compute", "compat32", "graphics", "utility", "video", "display", "ngx")
DEFAULT_CAPABILITIES = frozenset({"utility", "compute"})

# What a capability needs of another, as NVIDIA's libraries do: NVENC and NVDEC (video)
# create a CUDA context, so they need libcuda and the nvidia-uvm nodes.
IMPLIED_CAPABILITIES = {"video": frozenset({"compute"})}

# Libraries per driver capability, by soname stem (docs/runtime-facts.md §4).
LIBRARIES = {
    "utility": ("libnvidia-ml", "libnvidia-cfg", "libnvidia-nscq"),
    "compute": (
        "libcuda", "libcudadebugger", "libnvidia-opencl", "libnvidia-ptxjitcompiler",
        "libnvidia-nvvm", "libnvidia-allocator", "libnvidia-gpucomp", "libnvidia-pkcs11",
        "libnvidia-pkcs11-openssl3",
    ),
    "video": ("libnvcuvid", "libnvidia-encode", "libnvidia-opticalflow", "libvdpau_nvidia"),
    "graphics": (
        "libnvidia-eglcore", "libnvidia-glcore", "libnvidia-tls", "libnvidia-glsi", "libnvidia-fbc",
        "libnvidia-rtcore", "libnvoptix", "libGLX_nvidia", "libEGL_nvidia", "libGLESv2_nvidia",
        "libGLESv1_CM_nvidia", "libnvidia-glvkspirv", "libnvidia-egl-gbm", "libnvidia-egl-wayland",
        "libnvidia-vulkan-producer",
    ),
    "ngx": ("libnvidia-ngx",),
}
LIBRARY_CAPABILITIES = frozenset(LIBRARIES)
BINARIES = {
    "utility": ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced"),
    "compute": ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"),
}
# Where the driver's programs are looked for when `driver-bin-dirs` is empty, in order, under
# the driver root: distribution packages and NVIDIA's installer (/usr/bin), GKE's layout
# (/usr/local/nvidia/bin in a container, /home/kubernetes/bin/nvidia/bin on a COS node), a
# driver container's root is read like a host's (docs/driver-layouts.md). Only ELF programs
# count: a shell wrapper in front of the real binary (GKE puts one in /usr/bin) is skipped.
BINARY_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/nvidia/bin", "/home/kubernetes/bin/nvidia/bin",
               "/usr/local/bin")
# Data files the GL, EGL and Vulkan loaders and Xorg look for, mounted read-only at the same
# path where present, as NVIDIA's toolkit does for `graphics` and `display`. "{version}" is
# the driver version.
DATA_FILES = {
    "graphics": (
        "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
        "/usr/share/vulkan/icd.d/nvidia_icd.json", "/etc/vulkan/icd.d/nvidia_icd.json",
        "/usr/share/vulkan/implicit_layer.d/nvidia_layers.json", "/etc/vulkan/implicit_layer.d/nvidia_layers.json",
        "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",
        "/usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json",
        "/usr/share/nvidia/nvoptix.bin",
    ),
    "display": (
        "/usr/lib/xorg/modules/drivers/nvidia_drv.so",
        "/usr/lib/xorg/modules/extensions/libglxserver_nvidia.so.{version}",
    ),
}
# IPC endpoints: (path, capability, is a directory). Mounted only where present.
IPC = (
    ("/var/run/nvidia-persistenced/socket", "utility", False),
    ("/var/run/nvidia-fabricmanager/socket", "utility", False),
    ("/tmp/nvidia-mps", "compute", True),
)
MULTIARCH = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu", "ppc64le": "powerpc64le-linux-gnu"}


# --- device nodes -------------------------------------------------------------------------

GPU_NODE_PREFIX = "/dev/nvidia"
MIG_NODE_PREFIX = "/dev/nvidia-caps/nvidia-cap"
# The driver's control nodes, which no GPU names: (container path, its major's name in
# /proc/devices, minor, the capability that needs it or None for every request). nvidiactl
# and nvidia-modeset are minors 255 and 254 of the GPUs' own major; the uvm nodes are what
# CUDA (compute) opens besides the GPU (NVIDIA's toolkit, internal/discover/graphics.go and
# charDevices).
CONTROL_NODES = (
    ("/dev/nvidiactl", "nvidia", 255, None),
    ("/dev/nvidia-uvm", "nvidia-uvm", 0, "compute"),
    ("/dev/nvidia-uvm-tools", "nvidia-uvm", 1, "compute"),
    ("/dev/nvidia-modeset", "nvidia", 254, "display"),
)


def gpu_nodes(devices) -> tuple:
    """The GPU and MIG access nodes among `devices` (oci.Device: /dev/nvidia<N>,
    /dev/nvidia-caps/nvidia-cap<N>); control nodes (nvidiactl, uvm) name no GPU."""
    found = []
    for device in devices:
        for prefix in (GPU_NODE_PREFIX, MIG_NODE_PREFIX):
            tail = device.path[len(prefix):] if device.path.startswith(prefix) else ""
            if tail.isdigit() and tail.isascii():
                found.append(device)
    return tuple(found)


# --- names: UUIDs, MIG ids, the CDI kind -------------------------------------------------

UUID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
MAX_UUID = 96  # NVML's buffer for a UUID is 96 bytes


def is_uuid(text) -> bool:
    """Whether `text` has the form of a GPU or MIG UUID (letters, digits and dashes after
    GPU- or MIG-). Everything that names files or log lines by UUID takes only these: a UUID
    the driver reports in another form is a host fault, never a path or a terminal escape."""
    return (isinstance(text, str) and text.startswith(("GPU-", "MIG-")) and 4 < len(text) <= MAX_UUID
            and set(text) <= UUID_CHARS)


def needs_mig_layout(ids, mig_config, mig_monitor, nodes) -> bool:
    """Whether matching a request to the host needs the host's MIG layout (from NVML): it
    names a MIG device by id (`ids`) or by access node (`nodes`, oci.Device), or asks for
    MIG configuration or monitoring (NVIDIA_MIG_CONFIG_DEVICES, NVIDIA_MIG_MONITOR_DEVICES)."""
    return (any(is_mig_id(i) for i in ids) or bool(mig_config or mig_monitor)
            or any(node.path.startswith(MIG_NODE_PREFIX) for node in nodes))


def is_mig_id(ident: str) -> bool:
    """A MIG UUID or GPU:MIG index pair (a PCI bus id such as 0000:18:00.0 is a whole GPU)."""
    if ident.upper().startswith("MIG-"):
        return True
    gpu, sep, mig = ident.partition(":")
    return bool(sep) and gpu.isdigit() and gpu.isascii() and mig.isdigit() and mig.isascii()


# gpuhook's own CDI kind: `gpuhook cdi generate` writes it and the device plugin's CDI
# strategies name it. NVIDIA's toolkit writes nvidia.com/gpu with the same device names, and
# two specs defining one device make a runtime refuse both (docs/cdi.md, "Next to NVIDIA's").
CDI_KIND = "gpuhook.example/gpu"
NVIDIA_VENDOR = "nvidia.com"
