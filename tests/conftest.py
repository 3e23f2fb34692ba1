"""Shared fixtures: a simulated GPU host, the probe helper, and runc testbeds.

The suite has three parts, and each test gets its part's marker from its folder:
tests/unit (marker `unit`: no root, no runtime, no compiler; `pytest tests/unit` is the inner
loop, and holds every test that needs none of them), tests/integration (marker `root`: real
runtimes, namespaces and the simulated host) and tests/device (marker `device`: a real NVIDIA
GPU). A test that asks for a root fixture (ROOT_FIXTURES) is marked `root` too, and fails
in tests/unit.

Tests that need root, runc, busybox or a C compiler skip on a developer machine that lacks
them, but FAIL under CI (GPUHOOK_STRICT=1, set by scripts/test, which .ci/run runs): a missing tool must never turn
into a green run.
"""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from helpers import testbed
from gpuhook.simulate import host as simhost

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
STRICT = os.environ.get("GPUHOOK_STRICT") == "1"


PART_MARKERS = {"unit": "unit", "integration": "root", "device": "device"}
# The fixtures that need root (a simulated host with device nodes, a static probe, runc): a
# test asking for one belongs in tests/integration. As in pip's tests/conftest.py, a unit test
# that asks for one fails at once instead of skipping (or, as root, silently passing).
ROOT_FIXTURES = frozenset({"sim_host", "probe", "bed", "gpus"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        part = os.path.relpath(str(item.path), HERE).split(os.sep)[0]
        if part in PART_MARKERS:
            item.add_marker(PART_MARKERS[part])
        wanted = sorted(ROOT_FIXTURES & set(getattr(item, "fixturenames", ())))
        if wanted:
            item.add_marker("root")
            if part == "unit":
                item.add_marker(pytest.mark.unit_asks_for_root(wanted))


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("unit_asks_for_root")
    if marker is not None:
        pytest.fail(f"a unit test asks for the root fixture(s) {', '.join(marker.args[0])}: "
                    "move it to tests/integration", pytrace=False)


def require(condition: bool, why: str) -> None:
    if condition:
        return
    if STRICT:
        pytest.fail(f"required in CI: {why}")
    pytest.skip(why)


def require_root_tools(*tools: str) -> None:
    require(os.geteuid() == 0, "needs root")
    for tool in tools:
        require(shutil.which(tool) is not None, f"needs {tool}")


@pytest.fixture(scope="session")
def sim_host(tmp_path_factory):
    """A 4-GPU simulated host shared by the session. Do not modify it; build your own."""
    require_root_tools("gcc", "ldconfig")
    return simhost.build(str(tmp_path_factory.mktemp("simhost") / "host"), gpus=4)


@pytest.fixture(scope="session")
def probe(tmp_path_factory):
    """The static probe binary (tests/helpers/probe.c)."""
    require_root_tools("gcc")
    out = str(tmp_path_factory.mktemp("probe") / "probe")
    subprocess.run(["gcc", "-static", "-O2", "-o", out, f"{HERE}/helpers/probe.c"], check=True)
    return out


def fake_ldconfig(directory, mode: str = "SPY") -> str:
    """A static stand-in for the host's ldconfig (tests/helpers/fake_ldconfig.c): SPY, HANG
    or FAIL. Returns its path, `directory`/ldconfig."""
    require_root_tools("gcc")
    out = os.path.join(str(directory), "ldconfig")
    defines = [] if mode == "SPY" else [f"-D{mode}"]
    subprocess.run(["gcc", "-static", "-O2", *defines, "-o", out, f"{HERE}/helpers/fake_ldconfig.c"], check=True)
    return out


@pytest.fixture
def bed(tmp_path):
    require_root_tools("runc")
    try:
        testbed.find_busybox()
    except testbed.TestbedError as err:
        require(False, str(err))
    return testbed.Testbed(str(tmp_path))


def write_config(path, base: dict, **overrides) -> str:
    """A config.toml: the simulated host's keys plus overrides (TOML-quoted via json)."""
    lines = [f'{k} = {json.dumps(v)}' for k, v in {**base, **overrides}.items() if not isinstance(v, dict)]
    for section, values in overrides.items():
        if isinstance(values, dict):
            lines.append(f"[{section}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def sim_config_values(sim: dict, log_file: str) -> dict:
    """A test's config on the simulated host: everything the hook writes (log, state, caches)
    goes under the log file's directory, and the CDI specs it reads are that directory's own,
    never the host's /etc/cdi or /var/run/cdi."""
    d, mine = sim["directory"], os.path.dirname(log_file)
    return {"driver-root": f"{d}/driver", "dev-root": f"{d}/dev", "proc-root": f"{d}/proc", "sys-root": f"{d}/sys",
            "log-file": log_file, "state-dir": f"{mine}/run", "cdi-spec-dirs": [f"{mine}/cdi"]}


# A config gpuhook cannot load names no log file, so the hook logs to the default
# /var/log/gpuhook.log: hooks that are to fail that way run where /var/log is a tmpfs of their own.
PRIVATE_VAR_LOG = ["unshare", "--mount", "--propagation", "private", "sh", "-ec",
                   'mount -t tmpfs tmpfs /var/log && exec "$@"', "sh"]


def run_hook_process(args, stdin: bytes, env=None, timeout=60, python_flags=(), wrapper=()):
    """Run `python -I -S gpuhook/launch.py ARGS` as a runtime would (under `wrapper`, an argv
    prefix such as PRIVATE_VAR_LOG)."""
    argv = [*wrapper, sys.executable, "-I", "-S", *python_flags, f"{REPO}/gpuhook/launch.py", *args]
    return subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout,
                          env=env if env is not None else {"PATH": "/usr/bin:/bin"})


LIBDIR = "/usr/lib64"  # busybox rootfses are not Debian-family


def assert_rootfs_clean(rootfs):
    """Nothing of a refused start is left in the rootfs."""
    assert not os.path.exists(rootfs + LIBDIR)
    assert not os.path.exists(rootfs + "/usr/bin/nvidia-smi")
    assert not os.path.exists(rootfs + "/etc/ld.so.cache")
NODE_PATHS = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"] + [f"/dev/nvidia{i}" for i in range(4)]


class GpuContainers:
    """Run busybox containers with gpuhook as prestart hook on the simulated host."""

    def __init__(self, bed, sim, probe, workdir):
        self.bed = bed
        self.sim = sim
        self.probe = probe
        self.workdir = str(workdir)
        self.log = f"{self.workdir}/gpuhook.log"
        self.version = sim["driver_version"]
        self.configure()

    def configure(self, **overrides) -> str:
        self.config = write_config(f"{self.workdir}/config.toml",
                                   sim_config_values(self.sim, self.log), **overrides)
        return self.config

    def uuid(self, index: int) -> str:
        return self.sim["gpus"][index]["uuid"]

    def run(self, name, env=(), mounts=(), annotations=None, privileged=False, before="",
            paths=(), hook=True, edit=None, rootfs_setup=None, stage="prestart", glibc=True):
        """Start container `name`; it runs `before` then probes NODE_PATHS + `paths`.

        With `glibc` the busybox rootfs gets an /etc/ld.so.conf like a glibc image, so the
        hook updates its ld cache; without, it is a static image and the hook must not."""
        script = f"{before}\n/bin/probe " + " ".join(NODE_PATHS + list(paths))
        hooks = {stage: [testbed.hook_entry(self.config, stage)]} if hook else None
        bundle_dir = f"{self.bed.workdir}/bundles/{name}"
        rootfs = self.bed.rootfs(f"{bundle_dir}/rootfs", files={"/bin/probe": self.probe})
        if glibc:
            os.makedirs(f"{rootfs}/etc", exist_ok=True)
            with open(f"{rootfs}/etc/ld.so.conf", "w") as f:
                f.write("include /etc/ld.so.conf.d/*.conf\n")
        if rootfs_setup is not None:
            rootfs_setup(rootfs)
        bundle = self.bed.bundle(name, ["/bin/busybox", "sh", "-c", script], env=env, mounts=mounts,
                                 annotations=annotations, hooks=hooks, rootfs=rootfs,
                                 privileged=privileged, edit=edit)
        result = self.bed.run(bundle, name)
        result.rootfs = rootfs
        return result

    def log_lines(self) -> list:
        try:
            with open(self.log) as f:
                return [json.loads(line) for line in f]
        except FileNotFoundError:
            return []


@pytest.fixture
def gpus(bed, sim_host, probe, tmp_path):
    return GpuContainers(bed, sim_host, probe, tmp_path)


def host_mounts() -> list:
    """The host's mount table (mount point and source), for before/after comparisons."""
    with open("/proc/self/mountinfo") as f:
        return sorted(" ".join(line.split()[3:5]) for line in f)


def private_nvml_state(sim: dict, tmp_path, monkeypatch) -> str:
    """A test's own copy of a simulated host's NVML state, which the simulated library and
    nvidia-smi of this test process (and its children) then read."""
    from gpuhook.simulate import nvml as simnvml

    path = str(tmp_path / "nvml.json")
    shutil.copy(sim["nvml_state"], path)
    monkeypatch.setenv(simnvml.ENV_VAR, path)
    return path


@contextlib.contextmanager
def gpus_denied_parent(name: str, child: str):
    """A parent cgroup `name` (with the test's pid) whose devices controller denies every
    GPU ("c 195:* rw"; mknod stays: runc grants "c *:* m" itself), for a container whose
    cgroupsPath puts it there as `child`: gpuhook's grant then fails. Yields the bundle edit
    that does so; the parent is removed from every hierarchy afterwards."""
    parent = f"{name}-{os.getpid()}"
    os.makedirs(f"/sys/fs/cgroup/devices/{parent}", exist_ok=True)
    try:
        with open(f"/sys/fs/cgroup/devices/{parent}/devices.deny", "w") as f:
            f.write("c 195:* rw")

        def under_parent(spec):
            spec["linux"]["cgroupsPath"] = f"/{parent}/{child}"

        yield under_parent
    finally:
        remove_cgroup_everywhere(parent, child)


def remove_cgroup_everywhere(name: str, child: str) -> None:
    """A test's parent cgroup `name` (made in the devices hierarchy to deny a rule) in every
    hierarchy, with the container's `child` below it: runc makes the parent in each hierarchy
    it uses, and the host is to be left as it was (one set per run was left behind before).
    Asserts none is left."""
    import glob

    for root in sorted(glob.glob("/sys/fs/cgroup/*/")):
        for path in (os.path.join(root, name, child), os.path.join(root, name)):
            for _ in range(50):
                if not os.path.isdir(path):
                    break
                try:
                    os.rmdir(path)
                except OSError:
                    time.sleep(0.1)
    assert not glob.glob(f"/sys/fs/cgroup/*/{name}")
