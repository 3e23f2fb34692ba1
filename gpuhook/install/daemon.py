"""The containerd that runs on a node, and the default runtime spec of that very release.

containerd's CRI plugin uses a base runtime spec as it is, instead of the default spec it
generates itself for each container; so the spec `gpuhook install containerd` writes must be
the default of the containerd that will read it, not of whichever `ctr` is first on a PATH
(Debian's ctr 1.6 next to a containerd 2.x from the release tarball in /usr/local/bin gives a
1.6 default: no /sys/devices/virtual/powercap mask, among others). `ctr oci spec` prints
its own release's default without asking the daemon, so the ctr used is the one installed
next to the containerd binary that serves the config's socket.

The daemon is found by kernel facts, not by name: a process listening on the config's gRPC
socket (its inode in the process's own /proc/<pid>/net/unix, held among its fds); its binary
is /proc/<pid>/exe. With `node_root` (install --host-root, the DaemonSet's init container
with hostPID) the node's processes are in /proc and its files under `node_root`, and the
node's binaries run chrooted there.
"""

import os
import subprocess

from gpuhook.install.common import InstallError

DEFAULT_ADDRESS = "/run/containerd/containerd.sock"
# containerd 2.3 (config version 4) moved the server settings into plugins
# (cmd/containerd/server/config/config.go, serviceMigrate).
GRPC_PLUGIN = "io.containerd.server.v1.grpc"
# Where a containerd binary is looked for when none runs: the release tarball's place first.
SEARCH_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin", "/opt/bin")
RUN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
# /proc/net/unix: the flags of a listening socket (__SO_ACCEPTCON) and the state unconnected.
_LISTENING = 0x10000


class RunningContainerd:
    """A running containerd: its pid and its binary (the node's path)."""

    def __init__(self, pid: int, binary: str):
        self.pid = pid
        self.binary = binary


class DefaultSpec:
    """containerd's default spec as `ctr oci spec` printed it, and where it came from."""

    def __init__(self, text: str, ctr: str, source: str):
        self.text = text
        self.ctr = ctr
        self.source = source


def grpc_address(doc: dict) -> str:
    """The gRPC socket a parsed config.toml names (any config version), or containerd's default."""
    plugins = doc.get("plugins") if isinstance(doc.get("plugins"), dict) else {}
    for table in (plugins.get(GRPC_PLUGIN), doc.get("grpc")):
        if isinstance(table, dict) and isinstance(table.get("address"), str) and table["address"]:
            return table["address"]
    return DEFAULT_ADDRESS


def _listening_inodes(pid: int, address: str, proc: str) -> set:
    """Inodes of the unix sockets listening on `address` in the network namespace of `pid`."""
    found = set()
    try:
        with open(f"{proc}/{pid}/net/unix", "rb") as f:
            lines = f.read(16 << 20).decode(errors="replace").splitlines()[1:]
    except OSError:
        return found
    for line in lines:
        fields = line.split(None, 7)
        if len(fields) == 8 and fields[7] == address:
            try:
                if int(fields[3], 16) & _LISTENING:
                    found.add(fields[6])
            except ValueError:
                continue
    return found


def _holds(pid: int, inodes: set, proc: str) -> bool:
    wanted = {f"socket:[{inode}]" for inode in inodes}
    try:
        fds = os.listdir(f"{proc}/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"{proc}/{pid}/fd/{fd}") in wanted:
                return True
        except OSError:
            continue
    return False


def running(address: str, proc: str = "/proc") -> RunningContainerd | None:
    """The containerd process listening on the unix socket `address`, or None."""
    try:
        pids = [int(name) for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return None
    for pid in sorted(pids):
        try:
            with open(f"{proc}/{pid}/comm") as f:
                if f.read(64).strip() != "containerd":
                    continue
            binary = os.readlink(f"{proc}/{pid}/exe")
        except OSError:
            continue
        inodes = _listening_inodes(pid, address, proc)
        if inodes and _holds(pid, inodes, proc):
            # A binary replaced by an upgrade reads "PATH (deleted)"; after the restart
            # install asks for, the file now at PATH is what runs.
            return RunningContainerd(pid, binary.removesuffix(" (deleted)"))
    return None


def _on_node(node_root: str, path: str) -> str:
    return os.path.join(node_root, path.lstrip("/")) if node_root else path


def _is_program(node_root: str, path: str) -> bool:
    full = _on_node(node_root, path)
    return os.path.isfile(full) and os.access(full, os.X_OK)


def _run(node_root: str, argv: list) -> subprocess.CompletedProcess:
    """Run a node's binary (chrooted into `node_root` when one is given)."""
    chroot = (lambda: (os.chroot(node_root), os.chdir("/"))) if node_root else None
    try:
        return subprocess.run(argv, capture_output=True, timeout=60, cwd="/", stdin=subprocess.DEVNULL,
                              env=RUN_ENV, preexec_fn=chroot)
    except (OSError, subprocess.SubprocessError) as err:
        raise InstallError(f"{argv[0]} {' '.join(argv[1:2])} did not run: {err}") from err


def version(node_root: str, binary: str) -> str:
    """The release a containerd or ctr binary reports (`--version`: NAME PACKAGE VERSION ...)."""
    done = _run(node_root, [binary, "--version"])
    fields = done.stdout.decode(errors="replace").split()
    if done.returncode != 0 or len(fields) < 3:
        raise InstallError(f"{binary} --version did not say its version")
    return fields[2]


def _refuse_an_older_release(config_doc: dict, node_root: str, binary: str, address: str) -> None:
    """Config versions 3 and 4 are containerd 2's (1.x reads 1 and 2 only): with none running,
    a containerd 1.x found installed is not the release that will read this config, and its
    default spec (ociVersion, masked paths) is another release's."""
    wanted = config_doc.get("version")
    if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 3:
        return
    release = version(node_root, binary)
    if release.lstrip("v").split(".")[0] in ("0", "1"):
        raise InstallError(f"the config is version {wanted} (containerd 2), but no containerd serves {address} and "
                           f"the one installed at {binary} is {release}: its default spec is another release's",
                           "start the containerd 2 that reads this config and run install again, or give its "
                           "default spec (`ctr oci spec` of that release) with --base-spec FILE")


def default_spec(config_doc: dict, node_root: str = "", proc: str = "/proc") -> DefaultSpec:
    """`ctr oci spec` of the containerd that serves the config's socket: the ctr beside its
    binary, or, when that dir has none, a ctr of the same release; with no containerd
    running, the ctr beside the first containerd in SEARCH_PATH. Raises InstallError when no
    ctr of the right release is there."""
    address = grpc_address(config_doc)
    daemon = running(address, proc)
    if daemon is not None:
        binary, where = daemon.binary, f"the running containerd (pid {daemon.pid}, {daemon.binary})"
    else:
        binary = next((os.path.join(d, "containerd") for d in SEARCH_PATH
                       if _is_program(node_root, os.path.join(d, "containerd"))), None)
        if binary is None:
            raise InstallError(f"no containerd serves {address} and none is installed in {':'.join(SEARCH_PATH)}",
                               "install containerd, or give its default spec with --base-spec FILE")
        where = f"{binary} (no containerd serves {address} now)"
        _refuse_an_older_release(config_doc, node_root, binary, address)
    ctr = os.path.join(os.path.dirname(binary), "ctr")
    if _is_program(node_root, ctr):
        source = f"{ctr}, next to {where}"
    else:
        want = version(node_root, binary)
        ctr = next((os.path.join(d, "ctr") for d in SEARCH_PATH if _is_program(node_root, os.path.join(d, "ctr"))
                    and version(node_root, os.path.join(d, "ctr")) == want), None)
        if ctr is None:
            raise InstallError(f"no ctr of containerd {want} ({where}) is installed: another release's default spec "
                               "would differ from what this containerd generates",
                               f"give containerd {want}'s default spec (`ctr oci spec` of that release) with "
                               "--base-spec FILE")
        source = f"{ctr} (containerd {want}, the release of {where})"
    done = _run(node_root, [ctr, "oci", "spec"])
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise InstallError(f"{ctr} oci spec failed: {tail[0][:200]}")
    return DefaultSpec(done.stdout.decode(errors="replace"), ctr, source)
