"""The driver's files on the host: libraries, programs, data files, firmware, IPC endpoints,
and the host's ldconfig.

Found under the driver root the way NVIDIA's toolkit finds them (docs/driver-layouts.md): the
driver root's ld cache (gpuhook.discover.ldcache) and the layouts' library directories for
libraries, the binary directories for programs (ELF only: gpuhook.discover.elf), the versioned
paths for data files and firmware. Every path is resolved inside the driver root; reads only.
"""

import os
import stat

from gpuhook.discover.types import HostFile, Library
from gpuhook.driver import BINARIES, BINARY_DIRS, DATA_FILES, IPC, LIBRARIES
from gpuhook.errors import HostError
from gpuhook.record import record

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
    from gpuhook.discover import ldcache  # only when the scan is (re)built, not on a cached start

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
