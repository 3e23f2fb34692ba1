"""The host preflight: whether this host can start GPU containers, one check at a time.

`gpuhook doctor` runs every check; `gpuhook list` and `gpuhook prestart --dry-run` run the
quick ones (files only: no NVML, no socket, no runtime configuration) and warn about what is
not ok. Each check is a `HostCheck`: its name, ok / warn / fail / skip, one line saying what was
found, and a hint saying what to do. "fail" means GPU starts fail (every one, or every one of
a kind); "warn" means they start without something (nvidia-smi, CUDA's uvm node, the log) or
slower than they could. Checks only read: nothing here creates, writes or loads anything but
NVML (`nvml`, not in the quick set). docs/driver-layouts.md has the facts they rely on.
"""

import json
import os
import stat

from gpuhook.discover import driverfiles, proc as discover_proc, survey, types
from gpuhook import driver as gpuhook_driver
from gpuhook.errors import GpuhookError, NvmlError
from gpuhook.record import record

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
MAX_HOOK_FILES = 256  # files looked at per hooks.d or CDI directory
MAX_READ = 1 << 20


class HostCheck(record("HostCheck", "name status summary hint", defaults=(None,))):
    """One preflight check's verdict: `status` is OK, WARN, FAIL or SKIP."""

    __slots__ = ()

    def as_dict(self) -> dict:
        return self._asdict()


def run(config, quick: bool = False, root: str = "/") -> list:
    """Every check for `config` (the quick ones only with `quick`), in a fixed order.
    `root` is where the runtimes' configuration is read (a node's root in a DaemonSet)."""
    inventory, libraries_problem = None, None
    proc = config.proc_root
    try:
        version = discover_proc.driver_version(proc)
        inventory = types.Inventory(
            driver_version=version, gpus=discover_proc.gpus(proc), majors=discover_proc.majors(proc), libraries=(),
            binaries=(), firmware=(), ipc=(), proc_driver_dir=f"{proc}/driver/nvidia",
            capabilities=discover_proc.capabilities(proc))
    except GpuhookError as err:
        driver = HostCheck("driver", FAIL, err.message, err.hint or "is the NVIDIA kernel module loaded?")
    except OSError as err:
        driver = HostCheck("driver", FAIL, f"cannot read the driver's files: {err.strerror}")
    else:
        driver = _driver(inventory)
        try:
            libraries = driverfiles.libraries(config.driver_root, lib_dirs=config.driver_lib_dirs, version=version)
            inventory = inventory._replace(libraries=libraries)
        except (GpuhookError, OSError) as err:
            libraries_problem = HostCheck("driver-libraries", FAIL, getattr(err, "message", None) or str(err),
                                          "set driver-root or driver-lib-dirs to where the driver's libraries are")
    checks = [driver]
    for name, check in (("device-majors", _majors), ("device-nodes", _nodes), ("driver-libraries", _libraries)):
        if inventory is None:
            checks.append(HostCheck(name, SKIP, "no driver to check against"))
        elif name == "driver-libraries" and libraries_problem is not None:
            checks.append(libraries_problem)
        else:
            checks.append(check(config, inventory))
    checks += [_programs(config), _ldconfig(config), _cgroup(root), _state_dir(config), _log(config)]
    if not quick:
        checks += [_health_daemon(config), _nvml(config, inventory), _runtimes(config, root)]
    return checks


def problems(checks) -> list:
    """The checks that are not ok (warn or fail)."""
    return [c for c in checks if c.status in (WARN, FAIL)]


def _driver(inventory) -> HostCheck:
    gpus = inventory.gpus
    if not gpus:
        return HostCheck("driver", WARN, f"driver {inventory.driver_version} is loaded but lists no GPU",
                     "are the GPUs bound to the nvidia driver and not excluded (NVreg_ExcludedGpus)?")
    return HostCheck("driver", OK, f"driver {inventory.driver_version}, {len(gpus)} GPU(s) "
                               f"({', '.join(g.bus_id for g in gpus[:8])}{' ...' if len(gpus) > 8 else ''})")


def _majors(config, inventory) -> HostCheck:
    majors = inventory.majors
    listed = ", ".join(f"{name} {major}" for name, major in sorted(majors.items()) if name.startswith("nvidia"))
    if "nvidia-uvm" not in majors:
        return HostCheck("device-majors", WARN, f"nvidia-uvm is not loaded ({listed}): CUDA programs in containers "
                                            f"cannot start", "modprobe nvidia-uvm (or nvidia-modprobe -u -c=0)")
    if "nvidia-caps" not in majors and discover_proc.has_mig_instances(inventory.capabilities):
        return HostCheck("device-majors", FAIL, f"MIG instances exist but nvidia-caps has no major ({listed}): "
                                            f"MIG requests fail", "reload the nvidia module with nvidia-caps")
    return HostCheck("device-majors", OK, listed)


def _nodes(config, inventory) -> HostCheck:
    wanted = [("/dev/nvidiactl", inventory.majors["nvidia"], 255)]
    if "nvidia-uvm" in inventory.majors:
        wanted += [("/dev/nvidia-uvm", inventory.majors["nvidia-uvm"], 0),
                   ("/dev/nvidia-uvm-tools", inventory.majors["nvidia-uvm"], 1)]
    wanted += [(gpu.node, inventory.majors["nvidia"], gpu.minor) for gpu in inventory.gpus]
    missing, wrong = [], []
    for path, major, minor in wanted:
        found = survey.host_node(config, path)
        try:
            rdev = os.stat(found[3]).st_rdev if found is not None else None
        except OSError:
            rdev = None
        if rdev is None:
            missing.append(path)
            continue
        if (os.major(rdev), os.minor(rdev)) != (major, minor):
            wrong.append(f"{found[3]} is c {os.major(rdev)}:{os.minor(rdev)}, the driver's is c {major}:{minor}")
    if wrong:
        return HostCheck("device-nodes", FAIL, "; ".join(wrong), "remove the stale nodes and run nvidia-modprobe "
                                                           "(or nvidia-smi once) to make them again")
    if missing:
        return HostCheck("device-nodes", WARN, f"missing in {config.device_root}: {', '.join(missing)}: gpuhook makes "
                                           f"them in containers, but user-namespaced containers (which bind the "
                                           f"host's nodes) fail", "nvidia-modprobe -c0 -u, or nvidia-smi once as root")
    return HostCheck("device-nodes", OK, f"{len(wanted)} node(s) in {config.device_root} with the driver's numbers")


def _libraries(config, inventory) -> HostCheck:
    libs = inventory.libraries
    where = (f"driver-lib-dirs {', '.join(config.driver_lib_dirs)}" if config.driver_lib_dirs
             else f"the ld cache of {config.driver_root} and {', '.join(driverfiles.LAYOUT_LIB_DIRS[:1])} ...")
    missing = [stem for stem in ("libcuda", "libnvidia-ml")
               if not any(lib.bits == 64 and lib.file_name.startswith(stem + ".so.") for lib in libs)]
    if missing:
        return HostCheck("driver-libraries", FAIL, f"no {' or '.join(missing)} in {where}: containers get no working "
                                               f"driver", "set driver-root (a driver container's root) or "
                                                          "driver-lib-dirs to where the driver's libraries are")
    stale = [lib.file_name for lib in libs
             if lib.file_name.startswith(("libcuda.so.", "libnvidia-ml.so."))
             and not lib.file_name.endswith(f".so.{inventory.driver_version}")]
    if stale:
        return HostCheck("driver-libraries", WARN, f"{', '.join(stale)} do not match the kernel module "
                                               f"{inventory.driver_version}: CUDA and NVML fail with a version "
                                               f"mismatch", "install the libraries of the running driver, or reboot "
                                                            "into the module that matches them")
    dirs = sorted({lib.host_path.rsplit("/", 1)[0] for lib in libs})
    caps = sorted({lib.capability for lib in libs})
    return HostCheck("driver-libraries", OK, f"{len(libs)} libraries ({', '.join(caps)}) in {', '.join(dirs[:3])}")


def _programs(config) -> HostCheck:
    try:
        lookup = driverfiles.find_binaries(config.driver_root, config.driver_bin_dirs)
    except OSError as err:
        return HostCheck("driver-programs", FAIL, f"cannot look for the driver's programs: {err.strerror}")
    skipped = ""
    if lookup.skipped:
        path, why = lookup.skipped[0]
        more = f" and {len(lookup.skipped) - 1} more" if len(lookup.skipped) > 1 else ""
        skipped = f"skipped {path}{more} ({why})"
    smi = next((f.host_path for f in lookup.found if f.container_path == "/usr/bin/nvidia-smi"), None)
    if smi is None:
        dirs = ", ".join(config.driver_bin_dirs or gpuhook_driver.BINARY_DIRS)
        return HostCheck("driver-programs", WARN, f"no nvidia-smi program in {dirs} under {config.driver_root}"
                                              + (f"; {skipped}" if skipped else "")
                                              + ": utility containers get none",
                     "set driver-bin-dirs to the driver's own bin directory")
    names = ", ".join(f.container_path.rsplit("/", 1)[1] for f in lookup.found)
    return HostCheck("driver-programs", OK, f"{names} from {os.path.dirname(smi)}" + (f"; {skipped}" if skipped else ""))


def _ldconfig(config) -> HostCheck:
    found = driverfiles.find_ldconfig(config.ldconfig, config.driver_root)
    if found.path is None:
        return HostCheck("ldconfig", FAIL, f"{found.problem}: every start of a glibc image fails", found.hint)
    return HostCheck("ldconfig", OK, f"{found.path}, statically linked" + (f" ({found.note})" if found.note else ""))


def _cgroup(root: str) -> HostCheck:
    from gpuhook.kernel import mountinfo

    try:
        mounts = mountinfo.cgroup_mounts_here()
    except OSError as err:
        return HostCheck("cgroup", FAIL, f"cannot read the mount table: {err.strerror}")
    unified = any(fstype == "cgroup2" and point == "/sys/fs/cgroup" for fstype, _, point, _ in mounts)
    devices_v1 = any(fstype == "cgroup" and "devices" in options for fstype, _, _, options in mounts)
    systemd = os.path.isdir(f"{root.rstrip('/')}/run/systemd/system")
    manager = "; systemd scopes also get DeviceAllow= (docs/cgroup-v2.md)" if systemd else ""
    if unified:
        harden = _read_small("/proc/sys/net/core/bpf_jit_harden")
        if harden == "2":
            return HostCheck("cgroup", FAIL, "cgroup v2, and net.core.bpf_jit_harden = 2 blinds the runtime's device "
                                         "program: gpuhook cannot extend it, every GPU start fails",
                         "sysctl -w net.core.bpf_jit_harden=1 (hardening for unprivileged programs only)")
        release = os.uname().release.split("-")[0].split(".")
        old = [int(p) for p in release[:2] if p.isdigit()] < [5, 6]
        how = ("attach-then-detach (kernel before 5.6: no BPF_F_REPLACE)" if old
               else "replaced atomically (BPF_F_REPLACE)")
        return HostCheck("cgroup", OK, f"cgroup v2: the runtime's device program is extended and {how}{manager}")
    if devices_v1:
        hybrid = " (hybrid: cgroup2 mounted too)" if any(m[0] == "cgroup2" for m in mounts) else ""
        return HostCheck("cgroup", OK, f"cgroup v1{hybrid}: rules are appended to devices.allow{manager}")
    return HostCheck("cgroup", FAIL, "neither cgroup v2 at /sys/fs/cgroup nor a v1 devices controller is mounted: "
                                 "gpuhook cannot allow the GPUs", "mount the cgroup hierarchy (systemd does at boot)")


def _read_small(path: str) -> str:
    try:
        with open(path) as f:
            return f.read(64).strip()
    except OSError:
        return ""


def _root_only(st) -> bool:
    return st.st_uid == 0 and not st.st_mode & 0o022


def _state_dir(config) -> HostCheck:
    path = config.state_dir
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(path)
        while parent != "/" and not os.path.lexists(parent):
            parent = os.path.dirname(parent)
        if os.path.isdir(parent):
            return HostCheck("state-dir", OK, f"{path} does not exist yet; the first GPU start makes it")
        return HostCheck("state-dir", FAIL, f"{path} cannot be made: {parent} is not a directory",
                     "set state-dir to a directory under /run")
    except OSError as err:
        return HostCheck("state-dir", FAIL, f"{path}: {err.strerror}")
    if not stat.S_ISDIR(st.st_mode) or not _root_only(st):
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else (
            "not a directory" if not stat.S_ISDIR(st.st_mode) else
            f"owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}")
        return HostCheck("state-dir", FAIL, f"{path} is {what}: gpuhook trusts no state file there (no inventory "
                                        f"cache; whoever else can write it can plant files that block starts)",
                     f"set state-dir to a root-only directory (the default /run/gpuhook), or chown root:root "
                     f"{path} && chmod 0700 {path}")
    return HostCheck("state-dir", OK, f"{path}, root's only")


def _log(config) -> HostCheck:
    found, bad = [], []
    if config.log_target in ("file", "both"):
        if not config.log_file:
            found.append("log-file off")
        else:
            directory = os.path.dirname(config.log_file)
            if not os.path.isdir(directory):
                bad.append(f"{directory} (of log-file) does not exist")
            elif os.path.islink(config.log_file):
                bad.append(f"{config.log_file} is a symlink")
            else:
                found.append(config.log_file)
    if config.log_target in ("syslog", "both"):
        try:
            is_socket = stat.S_ISSOCK(os.stat(config.syslog_socket).st_mode)
        except OSError:
            is_socket = False
        if is_socket:
            found.append(f"syslog at {config.syslog_socket}")
        else:
            bad.append(f"{config.syslog_socket} is not a socket (no syslog daemon or journald?)")
    if bad:
        return HostCheck("log", WARN, f"{'; '.join(bad)}: decision log lines are lost (a broken log never fails a "
                                  f"start)", "fix log-file, log-target or syslog-socket")
    return HostCheck("log", OK, ", ".join(found))


def _health_daemon(config) -> HostCheck:
    from gpuhook.health.daemon import socket_path

    if config.health.mode == "off":
        return HostCheck("health-daemon", SKIP, "health checks are off (health.mode)")
    path = socket_path(config)
    try:
        st, parent = os.lstat(path), os.lstat(os.path.dirname(path) or ".")
    except FileNotFoundError:
        return HostCheck("health-daemon", OK, f"none at {path}: each GPU start checks its GPUs itself, loading NVML "
                                          f"(seconds per start without persistence mode)",
                     "run `gpuhook plugin` (Kubernetes) or `gpuhook plugin --standalone` to keep NVML loaded")
    except OSError as err:
        return HostCheck("health-daemon", WARN, f"{path}: {err.strerror}")
    if not stat.S_ISSOCK(st.st_mode) or not _root_only(st) or not _root_only(parent):
        return HostCheck("health-daemon", WARN, f"{path} is not a root-owned socket in a root-only directory: the hook "
                                            f"never asks it", "let the daemon make its socket (health.daemon-socket)")
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(2)
        sock.connect(path)  # then closed without a request: the daemon ignores it
    except OSError as err:
        return HostCheck("health-daemon", WARN, f"{path} does not answer ({err.strerror or err}): a stale socket; "
                                            f"the hook falls back to its own checks",
                     "restart `gpuhook plugin`, or remove the socket")
    finally:
        sock.close()
    return HostCheck("health-daemon", OK, f"listening at {path}")


def _nvml(config, inventory) -> HostCheck:
    from gpuhook.discover import nvml

    off = config.health.mode == "off"
    try:
        library = nvml.library_path(config)
        with nvml.Session(library) as session:
            seen = session.inventory()
    except GpuhookError as err:
        why = "health checks fail every GPU start" if not off else "list, MIG and NVIDIA_REQUIRE_* need it"
        # The line already says NVML does not load: a load failure adds only its reason.
        what = GpuhookError(err.reason, err.hint) if isinstance(err, NvmlError) and err.call == "load" else err
        return HostCheck("nvml", WARN if off else FAIL, f"NVML does not load: {what.one_line()}: {why}",
                     "set nvml-library to the driver's libnvidia-ml.so.1")
    if inventory is not None and seen.driver_version != inventory.driver_version:
        return HostCheck("nvml", FAIL, f"NVML ({library}) is driver {seen.driver_version}, the kernel module "
                                   f"{inventory.driver_version}", "point nvml-library at the running driver's NVML")
    notes = []
    for gpu in seen.gpus:
        if gpu.lost:
            notes.append(f"GPU {gpu.index} is lost (fallen off the bus)")
        elif gpu.mig_mode and not gpu.mig_devices:
            notes.append(f"GPU {gpu.index} is in MIG mode without MIG devices: CUDA sees no device on it")
        elif gpu.mig_mode is not None and gpu.mig_mode != gpu.mig_mode_pending:
            notes.append(f"GPU {gpu.index}'s MIG mode changes to {'on' if gpu.mig_mode_pending else 'off'} at its "
                         f"next reset")
    mig = [str(g.index) for g in seen.gpus if g.mig_mode]
    summary = (f"{library} loads: driver {seen.driver_version}, CUDA {seen.cuda_version}, {len(seen.gpus)} GPU(s), "
               f"MIG {'on for GPU ' + ', '.join(mig) if mig else 'off'}")
    if notes:
        return HostCheck("nvml", WARN, f"{summary}; {'; '.join(notes)}", "create MIG instances (nvidia-smi mig -cgi ...) "
                                                                     "or turn MIG off")
    return HostCheck("nvml", OK, summary)


def _runtimes(config, root: str) -> HostCheck:
    """Where gpuhook is registered (what `gpuhook install` writes), and whether each
    registration's interpreter and launcher exist."""
    from gpuhook.install import common, containerd, docker

    top = root.rstrip("/")
    found, broken = [], []

    def check_entry(entry, where):
        args = entry.get("args") if isinstance(entry.get("args"), list) else []
        for path in [entry.get("path")] + [a for a in args if isinstance(a, str) and a.endswith("/gpuhook/launch.py")]:
            if isinstance(path, str) and not os.path.exists(top + path):
                broken.append(f"{where} names {path}, which does not exist")
                return
        found.append(where)

    for directory, who in ((common.ADMIN_HOOKS_DIR, "podman"), (common.PACKAGE_HOOKS_DIR, "podman/CRI-O")):
        for name, doc in _json_files(top + directory):
            if isinstance(doc, dict) and common.is_gpuhook_entry(doc.get("hook")):
                check_entry(doc["hook"], f"{who} ({directory}/{name})")
    spec_path = containerd.configured_base_spec(_read_text(top + common.CONTAINERD_CONFIG))
    if spec_path:
        spec = _load_json(_read_text(top + spec_path))
        if isinstance(spec, dict) and common.has_gpuhook(spec):
            entry = next(e for s in common.STAGES for e in spec["hooks"].get(s) or [] if common.is_gpuhook_entry(e))
            check_entry(entry, f"containerd (base spec {spec_path})")
    launcher = top + docker.launcher_path(docker.DEFAULT_BIN_DIR)
    if docker.is_ours(_read_text(launcher)):
        found.append(f"docker --gpus ({docker.launcher_path(docker.DEFAULT_BIN_DIR)})")
    for directory in config.cdi_spec_dirs:
        for name, text in _files(top + directory, (".json", ".yaml", ".yml")):
            if "/gpuhook/launch.py" in text:
                found.append(f"CDI ({directory}/{name})")
    if broken:
        return HostCheck("runtimes", FAIL, "; ".join(broken) + ": those runtimes fail every GPU start",
                     "run gpuhook install for that runtime again")
    if not found:
        return HostCheck("runtimes", WARN, "gpuhook is registered with no runtime here",
                     "gpuhook install podman|crio|containerd|docker, or gpuhook cdi generate")
    return HostCheck("runtimes", OK, "; ".join(found))


def _read_text(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, MAX_READ).decode("utf-8", "replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def _load_json(text: str):
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def _files(directory: str, suffixes: tuple) -> list:
    """(name, text) of each regular file in `directory` whose name ends with `suffixes`."""
    try:
        names = sorted(os.listdir(directory))[:MAX_HOOK_FILES]
    except OSError:
        return []
    return [(name, _read_text(f"{directory}/{name}")) for name in names if name.endswith(suffixes)]


def _json_files(directory: str) -> list:
    """(name, parsed document or None) of each .json file in `directory`."""
    return [(name, _load_json(text)) for name, text in _files(directory, (".json",))]
