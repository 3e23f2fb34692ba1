"""Host discovery without NVML: GPUs, driver version, device majors and driver files.

Everything here is read from files (docs/runtime-facts.md §4): /proc/driver/nvidia gives each
GPU's UUID, minor and PCI bus without loading NVML (whose start-up can take seconds without
persistence mode), /proc/devices gives the majors, and the ld cache under the driver root
says where each library is. Roots are parameters so a driver container or a simulated host
(gpuhook simulate) is read exactly like a real one.
"""

import os
import stat

from gpuhook.errors import HostError
from gpuhook.record import record

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
# Library dirs of the layouts whose libraries no ld cache lists (GKE's), searched for what the
# driver root's ld cache lacks when `driver-lib-dirs` is empty.
LAYOUT_LIB_DIRS = ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/home/kubernetes/bin/nvidia/lib64",
                   "/home/kubernetes/bin/nvidia/lib")
# Where distributions put glibc's (statically linked) ldconfig, in the order tried when the
# `ldconfig` key is empty: Debian and Ubuntu keep it in /sbin (Ubuntu's /sbin/ldconfig is a
# shell wrapper in front of /sbin/ldconfig.real), RHEL and Fedora in /usr/sbin (Fedora 42
# merged /usr/sbin into /usr/bin), Arch in /usr/bin (docs/driver-layouts.md).
LDCONFIG_CANDIDATES = ("/sbin/ldconfig.real", "/sbin/ldconfig", "/usr/sbin/ldconfig.real", "/usr/sbin/ldconfig",
                       "/usr/bin/ldconfig", "/bin/ldconfig")
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


UUID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
MAX_UUID = 96  # NVML's buffer for a UUID is 96 bytes


def is_uuid(text) -> bool:
    """Whether `text` has the form of a GPU or MIG UUID (letters, digits and dashes after
    GPU- or MIG-). Everything that names files or log lines by UUID takes only these: a UUID
    the driver reports in another form is a host fault, never a path or a terminal escape."""
    return (isinstance(text, str) and text.startswith(("GPU-", "MIG-")) and 4 < len(text) <= MAX_UUID
            and set(text) <= UUID_CHARS)


class Gpu(record("Gpu", "index uuid minor bus_id model")):
    """One GPU as the driver's /proc files describe it; index = NVML order (by PCI bus id)."""

    __slots__ = ()

    @property
    def node(self) -> str:
        return f"/dev/nvidia{self.minor}"


class Library(record("Library", "host_path file_name sonames capability bits")):
    """A driver library file and the names (sonames, dev links) that must point at it."""

    __slots__ = ()


class HostFile(record("HostFile", "host_path container_path capability kind")):
    """A binary, firmware blob or IPC endpoint; `kind` is file, socket or dir."""

    __slots__ = ()


class Inventory(record(
    "Inventory", "driver_version gpus majors libraries binaries firmware ipc proc_driver_dir "
                 "mig_minors capabilities",
    defaults=({}, ()),
)):
    """What the host offers. `majors` maps /proc/devices names (nvidia, nvidia-uvm, ...) to
    majors; `mig_minors` maps nvidia-caps names ("config", "gpu0/gi1/access") to minors;
    `capabilities` lists the driver's capability files ("gpu0/mig/gi1/ci0/access"), which
    exist for each MIG instance."""

    __slots__ = ()


def _read(path: str, what: str, limit: int = 1 << 20) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except FileNotFoundError:
        raise
    except OSError as err:
        raise HostError(f"cannot read {what} {path}: {err.strerror}") from err


def driver_version(proc_root: str) -> str:
    path = f"{proc_root}/driver/nvidia/version"
    try:
        text = _read(path, "driver version")
    except FileNotFoundError:
        raise HostError(
            f"no NVIDIA driver: {path} does not exist",
            f"is the nvidia kernel module loaded? proc-root is {proc_root}",
        ) from None
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            for token in line.split():
                parts = token.split(".")
                if len(parts) >= 2 and all(p.isdigit() for p in parts):
                    return token
    raise HostError(f"{path}: no driver version in the NVRM line")


def majors(proc_root: str) -> dict:
    path = f"{proc_root}/devices"
    try:
        text = _read(path, "device list")
    except FileNotFoundError:
        raise HostError(f"{path} does not exist") from None
    found = {}
    in_char = False
    for line in text.splitlines():
        if line.startswith("Character devices"):
            in_char = True
            continue
        if line.startswith("Block devices"):
            in_char = False
            continue
        fields = line.split()
        if in_char and len(fields) == 2 and fields[0].isdigit():
            name = "nvidia" if fields[1] == "nvidia-frontend" else fields[1]
            found.setdefault(name, int(fields[0]))
    if "nvidia" not in found:
        raise HostError(f"{path} lists no nvidia character device major", "is the nvidia module loaded?")
    return found


def gpus(proc_root: str) -> tuple:
    base = f"{proc_root}/driver/nvidia/gpus"
    try:
        buses = sorted(os.listdir(base))
    except FileNotFoundError:
        return ()
    except OSError as err:
        raise HostError(f"cannot list {base}: {err.strerror}") from err
    found = []
    for bus in buses:
        path = f"{base}/{bus}/information"
        try:
            fields = _parse_information(_read(path, "GPU information"))
        except FileNotFoundError:
            continue
        if fields.get("GPU Excluded", "No").lower().startswith("y"):
            continue
        try:
            minor = int(fields["Device Minor"])
            uuid = fields["GPU UUID"]
        except (KeyError, ValueError):
            raise HostError(f"{path}: missing or bad 'GPU UUID' / 'Device Minor'") from None
        if not 0 <= minor < 254:
            raise HostError(f"{path}: device minor {minor} out of range")
        if not is_uuid(uuid):
            raise HostError(f"{path}: 'GPU UUID' is not a GPU UUID (GPU- followed by letters, digits and dashes)")
        bus_id = fields.get("Bus Location", bus).lower()
        found.append((bus_id, uuid, minor, fields.get("Model", "unknown")))
    found.sort()
    return tuple(Gpu(i, uuid, minor, bus_id, model) for i, (bus_id, uuid, minor, model) in enumerate(found))


def _parse_information(text: str) -> dict:
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def _stem_of(soname: str) -> str:
    return soname.split(".so", 1)[0]


def libraries(driver_root: str, machine: str | None = None, lib_dirs=(), version: str | None = None) -> tuple:
    """Driver libraries, 64-bit and 32-bit: from `lib_dirs` (under the driver root) when the
    operator named them, else from the driver root's ld cache plus, for libraries the cache
    lacks, the LAYOUT_LIB_DIRS that exist (docs/driver-layouts.md)."""
    machine = machine or os.uname().machine
    if lib_dirs:
        return _sorted_libraries(libraries_in_dirs(driver_root, lib_dirs, version, machine))
    try:
        found = _libraries_in_ld_cache(driver_root, machine)
        missing_cache = None
    except HostError as err:
        if not err.message.startswith("no ld cache"):
            raise
        found, missing_cache = [], err
    have = {(_stem_of(lib.file_name), lib.bits) for lib in found}
    found += [lib for lib in libraries_in_dirs(driver_root, LAYOUT_LIB_DIRS, version, machine)
              if (_stem_of(lib.file_name), lib.bits) not in have]
    if not found and missing_cache is not None:
        raise missing_cache
    return _sorted_libraries(found)


def _sorted_libraries(libs) -> tuple:
    return tuple(sorted(libs, key=lambda lib: (lib.capability, lib.bits, lib.file_name)))


def _libraries_in_ld_cache(driver_root: str, machine: str) -> list:
    from gpuhook.discover import ldcache  # only when the inventory is (re)built, not on a cached start

    arch = ldcache.ARCH_FLAGS.get(machine)
    if arch is None:
        raise HostError(f"unsupported machine {machine}")
    cache_path = under(driver_root, "/etc/ld.so.cache")
    entries = ldcache.read(cache_path)
    capability_of = _capability_of()
    by_file: dict = {}
    for entry in entries:
        cap = capability_of.get(_stem_of(entry.soname))
        if cap is None:
            continue
        if entry.arch_flags == arch:
            bits = 64
        elif entry.arch_flags == 0 and machine == "x86_64":
            bits = 32
        else:
            continue
        try:
            real = _resolve_in(driver_root, entry.path)
        except OSError:
            continue  # a stale cache entry: the file is gone
        host_path = under(driver_root, real)
        key = (host_path, bits)
        if key not in by_file:
            by_file[key] = [host_path, real.rsplit("/", 1)[1], [], cap, bits]
        names = by_file[key][2]
        link = entry.path.rsplit("/", 1)[1]
        for name in (entry.soname, link):
            if name != by_file[key][1] and name not in names:
                names.append(name)
    return [_library(host_path, file_name, names, cap, bits) for host_path, file_name, names, cap, bits in by_file.values()]


def _capability_of() -> dict:
    return {stem: cap for cap, stems in LIBRARIES.items() for stem in stems}


def _library(host_path: str, file_name: str, names: list, cap: str, bits: int) -> Library:
    if _stem_of(file_name) == "libcuda" and "libcuda.so" not in names:
        names = [*names, "libcuda.so"]  # programs dlopen() the dev name; NVIDIA makes it too
    return Library(host_path, file_name, tuple(names), cap, bits)


def libraries_in_dirs(driver_root: str, dirs, version: str | None, machine: str | None = None) -> list:
    """Driver libraries in `dirs` (under the driver root), for layouts no ld cache describes:
    files named <stem>.so.<...> (links followed inside the root) that are ELF libraries for
    this machine, with the soname their ELF header gives. Of several files of one library,
    the one named for the driver `version` wins (NVIDIA's toolkit also locates
    lib*.so.<version>), else the last by name."""
    from gpuhook.discover import elf

    machine = machine or os.uname().machine
    capability_of = _capability_of()
    chosen: dict = {}
    for directory in dirs:
        try:
            names = sorted(os.listdir(under(driver_root, directory)))[:MAX_DIR_ENTRIES]
        except OSError:
            continue
        for name in names:
            stem, dot_so, _ = name.partition(".so.")
            cap = capability_of.get(stem)
            if cap is None or not dot_so:
                continue
            try:
                real = _resolve_in(driver_root, f"{directory}/{name}")
                host_path = under(driver_root, real)
                if not stat.S_ISREG(os.stat(host_path).st_mode):
                    continue
                info = elf.read(host_path)
            except (OSError, ValueError):
                continue
            bits = elf.bits_on(info, machine)
            file_name = real.rsplit("/", 1)[1]
            if bits is None or info.kind != "dyn" or _stem_of(file_name) != stem:
                continue
            key = (stem, bits)
            exact = bool(version) and file_name.endswith(f".so.{version}")
            old = chosen.get(key)
            if old is not None and (old[0], old[1].file_name) >= (exact, file_name):
                continue
            sonames = [info.soname] if info.soname and info.soname != file_name else []
            chosen[key] = (exact, _library(host_path, file_name, sonames, cap, bits))
    return [lib for _, lib in chosen.values()]


MAX_DIR_ENTRIES = 4096  # names looked at per driver directory


def under(root: str, path: str) -> str:
    """Host path of `path` in the tree rooted at `root`."""
    return path if root == "/" else root + path


def _resolve_in(root: str, path: str) -> str:
    """`path` with symlinks resolved inside `root`, as a root-relative absolute path."""
    from gpuhook.kernel.paths import resolve_host

    real = resolve_host(root, path)
    if root != "/":
        top = os.path.realpath(root)
        if not real.startswith(top + "/"):
            raise OSError(2, "escapes the driver root", path)
        real = real[len(top):]
    os.stat(under(root, real))
    return real


class BinaryLookup(record("BinaryLookup", "found skipped")):
    """The driver's programs: `found` (HostFile each) and `skipped`, (path, why) of files of a
    program's name that are not its real binary (a shell wrapper, a dangling link)."""

    __slots__ = ()


def find_binaries(driver_root: str, dirs=()) -> BinaryLookup:
    """Each driver program (BINARIES) from the first of `dirs` (BINARY_DIRS when empty) that
    holds it as an ELF program, links followed inside the driver root. A shell script of that
    name is never taken: mounted into a container it would run whatever it names there."""
    from gpuhook.discover import elf

    found, skipped = [], []
    for cap, names in BINARIES.items():
        for name in names:
            for directory in dirs or BINARY_DIRS:
                path = f"{directory}/{name}"
                try:
                    real = under(driver_root, _resolve_in(driver_root, path))
                    if not stat.S_ISREG(os.stat(real).st_mode):
                        skipped.append((under(driver_root, path), "not a regular file"))
                        continue
                    elf.read(real)
                except FileNotFoundError:
                    continue
                except elf.NotElf as err:
                    skipped.append((under(driver_root, path), str(err)))
                    continue
                except OSError as err:
                    skipped.append((under(driver_root, path), err.strerror or str(err)))
                    continue
                found.append(HostFile(real, f"/usr/bin/{name}", cap, "file"))
                break
    return BinaryLookup(tuple(found), tuple(skipped))


def binaries(driver_root: str, dirs=()) -> tuple:
    """The driver's programs (`find_binaries`), each to be mounted at /usr/bin/<name>."""
    return find_binaries(driver_root, dirs).found


class HostLdconfig(record("HostLdconfig", "path note problem hint")):
    """The host's ldconfig for this host: `path` of a statically linked ELF ldconfig, or None
    with `problem` (and `hint`) saying why none can be used; `note` says how it was chosen
    when that is not simply the configured path."""

    __slots__ = ()


def find_ldconfig(configured: str, driver_root: str = "/", root: str = "/") -> HostLdconfig:
    """The ldconfig gpuhook runs for a glibc image (docs/ldconfig.md): `configured` (the
    `ldconfig` key) if it is a static ELF binary, else its `.real` sibling when that is one
    (Ubuntu's /sbin/ldconfig is a shell wrapper in front of /sbin/ldconfig.real; NVIDIA's
    toolkit normalizes its configured path the same way, api/config/v1/cli.go). An empty
    `configured` takes the first static one of LDCONFIG_CANDIDATES on the host (under
    `root`), then in the driver root (a driver container brings its own)."""
    if configured:
        problem = _ldconfig_problem(configured)
        if problem is None:
            return HostLdconfig(configured, None, None, None)
        base = configured[:-len(".real")] if configured.endswith(".real") else configured
        real = base + ".real"
        if real != configured and _ldconfig_problem(real) is None:
            return HostLdconfig(real, f"host ldconfig {configured} is not a static ELF binary (a wrapper): "
                                      f"using {real}", None, None)
        return HostLdconfig(None, None, problem, "set ldconfig to a statically linked ldconfig, or leave it "
                                                 "empty to find one (gpuhook doctor)")
    roots = [root] + ([driver_root] if driver_root != "/" and driver_root != root else [])
    seen = []
    for top in roots:
        for candidate in LDCONFIG_CANDIDATES:
            path = under(top, candidate)
            problem = _ldconfig_problem(path)
            if problem is None:
                note = f"host ldconfig: {path}" if candidate.endswith(".real") or top != root else None
                return HostLdconfig(path, note, None, None)
            if "No such file" not in problem:
                seen.append(problem)
    looked = ", ".join(under(top, c) for top in roots for c in LDCONFIG_CANDIDATES[:2])
    found = f"; {'; '.join(seen)}" if seen else ""
    return HostLdconfig(None, None, f"no static ldconfig on this host (looked for {looked} and the other "
                                    f"places distributions use){found}",
                        "install glibc's ldconfig (Debian/Ubuntu: libc-bin; RHEL/Fedora: glibc), or set ldconfig "
                        "to a statically linked ldconfig")


def _ldconfig_problem(path: str):
    """None when `path` is a 64-bit statically linked ELF program, else why it is not one."""
    from gpuhook.discover import elf

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        return f"host ldconfig {path}: {err.strerror}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return f"host ldconfig {path} is not a regular file"
        info = elf.read_fd(fd)
    except elf.NotElf:
        return f"host ldconfig {path} is not an ELF binary; gpuhook runs only a static ldconfig"
    except OSError as err:
        return f"host ldconfig {path}: {err.strerror}"
    finally:
        os.close(fd)
    if info.bits != 64:
        return f"host ldconfig {path} is not a 64-bit ELF binary"
    if info.interpreter:
        return (f"host ldconfig {path} is dynamically linked; in the container's root it would load the image's "
                f"loader (use the distribution's static ldconfig)")
    return None


def data_files(driver_root: str, version: str) -> tuple:
    """The DATA_FILES present under the driver root (regular files only, never a link out of
    it), each to be mounted at its own path."""
    found = []
    for cap, paths in DATA_FILES.items():
        for path in paths:
            path = path.format(version=version)
            host = under(driver_root, path)
            try:
                st = os.lstat(host)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                found.append(HostFile(host, path, cap, "file"))
    return tuple(found)


def firmware(driver_root: str, version: str) -> tuple:
    base = f"/lib/firmware/nvidia/{version}"
    host_dir = under(driver_root, base)
    try:
        names = sorted(os.listdir(host_dir))
    except OSError:
        return ()
    return tuple(
        HostFile(f"{host_dir}/{n}", f"{base}/{n}", "firmware", "file")
        for n in names
        if n.startswith("gsp") and n.endswith(".bin") and os.path.isfile(f"{host_dir}/{n}")
    )


def ipc(driver_root: str) -> tuple:
    found = []
    for path, cap, is_dir in IPC:
        host = under(driver_root, path)
        try:
            st = os.stat(host)
        except OSError:
            continue
        if is_dir and stat.S_ISDIR(st.st_mode):
            found.append(HostFile(host, path, cap, "dir"))
        elif not is_dir and stat.S_ISSOCK(st.st_mode):
            found.append(HostFile(host, path, cap, "socket"))
    return tuple(found)


def numa_node(sys_root: str, bus_id: str):
    """The NUMA node of the PCI device `bus_id` (e.g. 0000:07:00.0) from sysfs, or None when
    the machine has no NUMA information for it (a file that is missing or says -1)."""
    if not bus_id or "/" in bus_id or bus_id.startswith("."):
        return None
    try:
        text = _read(f"{sys_root}/bus/pci/devices/{bus_id}/numa_node", "NUMA node", 32)
    except (OSError, HostError):
        return None
    text = text.strip()
    if not text.isdigit() or len(text) > 4:
        return None
    return int(text)


def mig_minors(proc_root: str) -> dict:
    """The driver's nvidia-caps minor table (/proc/driver/nvidia-caps/mig-minors), or {}."""
    path = f"{proc_root}/driver/nvidia-caps/mig-minors"
    try:
        text = _read(path, "MIG minor table")
    except FileNotFoundError:
        return {}
    table = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].isdigit():
            table[fields[0]] = int(fields[1])
    return table


def capabilities(proc_root: str) -> tuple:
    """Relative paths of the files under /proc/driver/nvidia/capabilities: mig/config,
    mig/monitor and fabric-imex-mgmt on every host with a current driver, and
    gpu<minor>/mig/gi<G>/access and .../ci<C>/access for each MIG instance that exists."""
    base = f"{proc_root}/driver/nvidia/capabilities"
    found = []
    for directory, _, files in os.walk(base):
        rel = directory[len(base):].lstrip("/")
        found += [f"{rel}/{name}" if rel else name for name in files]
    return tuple(sorted(found))


def watched_dirs(config, version: str) -> list:
    """Host paths of the directories whose entries decide what `inventory` finds besides the
    ld cache: where the driver's programs, data files, firmware and (ld-cache-less)
    libraries are looked for. A package that adds or replaces a file there (dpkg and rpm
    rename files into place) changes the directory's mtime, which the inventory cache's key
    holds."""
    dirs = list(config.driver_bin_dirs or BINARY_DIRS)
    dirs += [path.format(version=version).rsplit("/", 1)[0] for paths in DATA_FILES.values() for path in paths]
    dirs.append(f"/lib/firmware/nvidia/{version}")
    dirs += config.driver_lib_dirs or LAYOUT_LIB_DIRS
    return [under(config.driver_root, d) for d in dict.fromkeys(dirs)]


def has_mig_instances(capabilities) -> bool:
    """Whether the driver's capability files (`capabilities`) show a MIG GPU instance.

    The driver makes mig/config and mig/monitor at load and a gpu<minor>/mig directory for
    every GPU, MIG-capable or not and whatever its MIG mode; gpu<minor>/mig/gi<G>/access
    appears only when GPU instance G is created (NVIDIA's open kernel modules, os.c:
    osRmCapRegisterSys, osRmCapRegisterGpu, osRmCapRegisterSmcPartition), and
    /proc/driver/nvidia-caps/mig-minors lists every possible instance always (nv-caps.c).
    So a GPU instance's access file is the one sign of MIG devices /proc gives without NVML
    (docs/runtime-facts.md §4)."""
    for path in capabilities:
        parts = path.split("/")
        if len(parts) >= 4 and parts[0].startswith("gpu") and parts[1] == "mig" and parts[2].startswith("gi"):
            return True
    return False


def inventory(config) -> Inventory:
    """Everything the plan needs to know about the host, read from files only."""
    proc_root = config.proc_root
    version = driver_version(proc_root)
    return Inventory(
        driver_version=version,
        gpus=gpus(proc_root),
        majors=majors(proc_root),
        libraries=libraries(config.driver_root, lib_dirs=config.driver_lib_dirs, version=version),
        binaries=binaries(config.driver_root, config.driver_bin_dirs) + data_files(config.driver_root, version),
        firmware=firmware(config.driver_root, version),
        ipc=ipc(config.driver_root),
        proc_driver_dir=f"{proc_root}/driver/nvidia",
        mig_minors=mig_minors(proc_root),
        capabilities=capabilities(proc_root),
    )


def inventory_to_dict(inventory: Inventory) -> dict:
    """JSON-ready form of an inventory (for the cache)."""
    doc = inventory._asdict()
    for field in ("gpus", "libraries", "binaries", "firmware", "ipc"):
        doc[field] = [item._asdict() for item in doc[field]]
    return doc


def inventory_from_dict(doc: dict) -> Inventory:
    """Inverse of inventory_to_dict; raises KeyError/TypeError on a damaged document."""
    return Inventory(
        driver_version=doc["driver_version"],
        gpus=tuple(Gpu(**g) for g in doc["gpus"]),
        majors=dict(doc["majors"]),
        libraries=tuple(Library(**dict(lib, sonames=tuple(lib["sonames"]))) for lib in doc["libraries"]),
        binaries=tuple(HostFile(**f) for f in doc["binaries"]),
        firmware=tuple(HostFile(**f) for f in doc["firmware"]),
        ipc=tuple(HostFile(**f) for f in doc["ipc"]),
        proc_driver_dir=doc["proc_driver_dir"],
        mig_minors={str(k): int(v) for k, v in doc["mig_minors"].items()},
        capabilities=tuple(str(p) for p in doc["capabilities"]),
    )


def host_node(config, path: str):
    """(mode, uid, gid, host path) of the host's device node for `path` (/dev/...), or None.

    Looked for under dev-root, else <driver-root>/dev falling back to /dev (a driver
    container's root usually has no /dev of its own)."""
    candidates = [config.device_root + path[len("/dev"):]]
    if not config.dev_root and candidates[0] != path:
        candidates.append(path)
    for host in candidates:
        try:
            st = os.stat(host)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, host
    return None


class ContainerFacts(record("ContainerFacts", "lib64 lib32 glibc")):
    """What the plan needs to know about the image: its library dirs, and whether it is a
    glibc image (has an ld cache, ld.so.conf or glibc's loader) whose ld cache to update."""

    __slots__ = ()


GLIBC_MARKERS = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/lib64/ld-linux-x86-64.so.2",
                 "/lib/ld-linux-aarch64.so.1", "/lib64/ld64.so.2")


def container_facts(rootfs: str, config, machine: str | None = None) -> ContainerFacts:
    """Read the image (never follow its symlinks out of it) for the plan.

    Debian-family images (an /etc/debian_version, or the multiarch dir already there) use
    /usr/lib/<multiarch>; everything else /usr/lib64 (and /usr/lib for 32-bit). An image
    without glibc (busybox, distroless static) has no ld cache to update: NVIDIA's toolkit
    skips ldconfig there too.
    """
    from gpuhook.kernel import paths as safepath
    from gpuhook.errors import InputError

    machine = machine or os.uname().machine
    multiarch = MULTIARCH.get(machine, f"{machine}-linux-gnu")
    try:
        root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise InputError(f"container rootfs {rootfs}: {err.strerror}") from err

    def exists(path):
        return safepath.exists_in_root(root, path)

    try:
        glibc = any(exists(p) for p in GLIBC_MARKERS)
        if config.container_lib_dir:
            lib64, lib32 = config.container_lib_dir, "/usr/lib/i386-linux-gnu"
        elif exists("/etc/debian_version") or exists(f"/usr/lib/{multiarch}"):
            lib64, lib32 = f"/usr/lib/{multiarch}", "/usr/lib/i386-linux-gnu"
        else:
            lib64, lib32 = "/usr/lib64", "/usr/lib"
    finally:
        os.close(root)
    return ContainerFacts(lib64, lib32, glibc)
