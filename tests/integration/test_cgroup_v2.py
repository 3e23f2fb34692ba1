"""Device access on pure cgroup v2: real runc containers, real eBPF device programs.

runc decides between v1 and v2 by what /sys/fs/cgroup is, so these containers run in a
private mount namespace with cgroup2 mounted there (docs/runtime-facts.md §5). A holder
process keeps that namespace alive and every runc command for the containers enters it with
nsenter. From outside, the namespace's cgroup tree is reachable under /proc/HOLDER/root.

Access is checked by errno inside the container as in tests/integration/test_runc_v1.py: ENXIO = the
device programs allow the node but no driver is behind it, EPERM = they deny it.

The last part tests gpuhook.apply.cgroup.systemd against a stand-in systemctl (systemd cannot run
here); docs/cgroup-v2.md says how to check it on a systemd host.
"""

import contextlib
import json
import os
import stat
import subprocess
import sys
import pytest
from helpers import testbed
from gpuhook.apply.cgroup import bpf, systemd, v2
from gpuhook.devrules import program
from gpuhook.devrules.devices import DeviceRule, parse_v1_line
from gpuhook.errors import ApplyError
from conftest import REPO, require, require_root_tools, sim_config_values, write_config
from helpers.bpfdata import RULE_SETS, golden
from helpers.runtimes import STRICT_POLICY, start_with_runtime_node


pytestmark = pytest.mark.root


HARDEN = "/proc/sys/net/core/bpf_jit_harden"


PATHS = ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/null", "/dev/zero"]


def R(text: str, allow: bool = True) -> DeviceRule:
    return parse_v1_line(text, allow)


class Namespace:
    """A private mount namespace with cgroup2 at /sys/fs/cgroup, kept by a sleeping holder."""

    def __init__(self, holder: subprocess.Popen):
        self.holder = holder
        self.wrapper = ["nsenter", f"--target={holder.pid}", "--mount", "--"]
        self.root = f"/proc/{holder.pid}/root"

    def run(self, argv, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([*self.wrapper, *argv], capture_output=True, text=True, timeout=60,
                              env=testbed.RUN_ENV, stdin=subprocess.DEVNULL, **kwargs)


@pytest.fixture(scope="module")
def v2ns():
    require_root_tools("unshare", "nsenter", "runc", "bpftool", "setpriv")
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               "mount -t cgroup2 cgroup2 /sys/fs/cgroup && echo ready && exec sleep infinity"],
                              stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=testbed.RUN_ENV)
    try:
        require(holder.stdout.readline() == b"ready\n", "cannot mount cgroup2 in a private mount namespace")
        yield Namespace(holder)
    finally:
        holder.kill()
        holder.wait()


@pytest.fixture
def bed(tmp_path, v2ns):
    """Overrides conftest's `bed` (and so the `gpus` fixture's): runc runs in the v2 namespace."""
    try:
        testbed.find_busybox()
    except testbed.TestbedError as err:
        require(False, str(err))
    return testbed.Testbed(str(tmp_path), wrapper=v2ns.wrapper)


def unique(name: str) -> str:
    # Container ids name cgroups directly under the cgroup2 root, shared by every test run
    # on the machine.
    return f"{name}-{os.getpid()}"


class Running:
    """A detached runc container (busybox sleeping) in the v2 namespace."""

    def __init__(self, ns, bed, gpus, name, env=(), hook_count=0, edit=None):
        self.ns, self.bed, self.id = ns, bed, unique(name)
        rootfs = bed.rootfs(f"{bed.workdir}/bundles/{self.id}/rootfs", files={"/bin/probe": gpus.probe})
        hooks = {"prestart": [testbed.hook_entry(gpus.config)] * hook_count} if hook_count else None
        self.bundle = bed.bundle(self.id, ["/bin/busybox", "sleep", "600"], env=env, hooks=hooks, rootfs=rootfs,
                                 edit=edit)
        self.started = None

    def __enter__(self):
        if self.started is None:
            self.start()
        return self

    def start(self) -> None:
        with open(f"{self.bundle}/stdio", "wb") as out:
            self.started = subprocess.run(
                [*self.ns.wrapper, self.bed.runc, "--root", self.bed.state_root, "run", "--detach", "--bundle",
                 self.bundle, self.id], stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=testbed.RUN_ENV,
                timeout=60)
        with open(f"{self.bundle}/stdio") as f:
            self.output = f.read()

    def __exit__(self, *exc):
        self.bed.delete(self.id)

    def runc(self, *args) -> subprocess.CompletedProcess:
        return self.ns.run([self.bed.runc, "--root", self.bed.state_root, *args])

    @property
    def pid(self) -> int:
        done = self.runc("state", self.id)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["pid"]

    @property
    def cgroup_dir(self) -> str:
        """The container's cgroup directory, as seen from outside the namespace."""
        with open(f"/proc/{self.pid}/cgroup") as f:
            (path,) = [line.split(":", 2)[2].strip() for line in f if line.startswith("0::")]
        return f"{self.ns.root}/sys/fs/cgroup{path}"

    def program_ids(self) -> list:
        fd = os.open(self.cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return bpf.query(fd)
        finally:
            os.close(fd)

    def probe(self, *paths) -> dict:
        done = self.runc("exec", self.id, "/bin/probe", *paths)
        assert done.returncode == 0, done.stderr
        return testbed.RunResult(0, done.stdout, done.stderr).probes()

    def mknod(self, path, major, minor) -> None:
        done = self.runc("exec", self.id, "/bin/busybox", "mknod", path, "c", str(major), str(minor))
        assert done.returncode == 0, done.stderr

    def show(self) -> dict:
        """`gpuhook cgroup show --pid PID --json`, run inside the namespace."""
        done = self.ns.run([sys.executable, "-m", "gpuhook", "cgroup", "show", "--pid", str(self.pid), "--json"])
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


def rules_of(shown_program: dict) -> list:
    return [DeviceRule(r["type"], -1 if r["major"] is None else r["major"], -1 if r["minor"] is None else r["minor"],
                       r["access"], r["allow"]) for r in shown_program["rules"]]


def planned_rules(sim, gpu: int) -> list:
    """What the hook grants for NVIDIA_VISIBLE_DEVICES=<gpu> (utility,compute), in plan order."""
    nvidia, uvm = sim["majors"]["nvidia"], sim["majors"]["nvidia-uvm"]
    minor = sim["gpus"][gpu]["minor"]
    return [R(f"c {nvidia}:255 rw"), R(f"c {uvm}:0 rw"), R(f"c {uvm}:1 rw"), R(f"c {nvidia}:{minor} rw")]


@pytest.fixture
def runc_rules(v2ns, bed, gpus):
    """The rules of runc's own device program for a plain container (runc's defaults)."""
    with Running(v2ns, bed, gpus, "baseline") as box:
        assert box.started.returncode == 0, box.output
        (only,) = box.show()["programs"]
        return rules_of(only)


def test_requested_gpu_opens_unrequested_is_denied_and_runcs_devices_still_work(gpus):
    name = unique("v2-gpu0")
    result = gpus.run(name, env=["NVIDIA_VISIBLE_DEVICES=0"], before="busybox mknod /dev/test-gpu1 c 195 1",
                      paths=["/dev/null", "/dev/zero", "/dev/test-gpu1"])
    assert result.returncode == 0, result.stderr
    p = result.probes()
    for node in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"):
        assert p[node]["read"] == "ENXIO" and p[node]["write"] == "ENXIO", p[node]
    assert p["/dev/test-gpu1"]["read"] == "EPERM"  # GPU 1 exists on the host but is not this container's
    assert p["/dev/null"]["read"] == "OK" and p["/dev/null"]["write"] == "OK"
    assert p["/dev/zero"]["read"] == "OK"
    (line,) = gpus.log_lines()
    assert line["decision"] == "gpus injected" and line["cgroup"] == "v2"
    assert line["rules_added"] == [r.v1_line() for r in planned_rules(gpus.sim, 0)]


@pytest.mark.parametrize("policy", [{}, STRICT_POLICY], ids=["default-policy", "strict-policy"])
@pytest.mark.parametrize("access", [None, "r"], ids=["not-allowed", "read-only"])
def test_a_gpu_node_runcs_program_denies_is_never_opened_by_the_hook(gpus, policy, access):
    """As tests/integration/test_cdi_runc.py on v1: the program gpuhook builds allows nothing
    of /dev/nvidia2 that runc's own program denied."""
    start_with_runtime_node(gpus, unique(f"v2-runtime-node-{access}-{len(policy)}"), policy, access)


def test_one_program_holds_runcs_rules_then_ours_and_runc_update_changes_nothing(v2ns, bed, gpus, runc_rules):
    ours = planned_rules(gpus.sim, 0)
    with Running(v2ns, bed, gpus, "v2-update", env=["NVIDIA_VISIBLE_DEVICES=0"], hook_count=1) as box:
        assert box.started.returncode == 0, box.output
        box.mknod("/dev/test-gpu1", 195, 1)

        def observe():
            (only,) = box.show()["programs"]
            probes = box.probe(*PATHS, "/dev/test-gpu1")
            return only, {path: (item["read"], item["write"]) for path, item in probes.items()}

        shown, access = observe()
        assert shown["name"] == program.PROGRAM_NAME and not shown["inherited"]
        assert rules_of(shown) == ours + runc_rules
        assert access["/dev/nvidia0"] == ("ENXIO", "ENXIO") and access["/dev/test-gpu1"] == ("EPERM", "EPERM")
        assert access["/dev/null"] == ("OK", "OK")

        # runc re-runs its whole cgroup update path whatever changes; pids is there on pure v2 hosts.
        with open(f"{box.cgroup_dir}/cgroup.controllers") as f:
            limits = ["--pids-limit", "321"] if "pids" in f.read().split() else []
        done = box.runc("update", *limits, box.id)
        assert done.returncode == 0, done.stderr
        assert observe() == (shown, access)


def test_running_the_hook_twice_leaves_the_programs_rules_unchanged(v2ns, bed, gpus, runc_rules):
    # A second gpuhook with a state dir of its own (the same one would find the start served:
    # gpuhook.apply.served) grants again on the same container.
    other = write_config(f"{bed.workdir}/other.toml", sim_config_values(gpus.sim, gpus.log),
                         **{"state-dir": f"{bed.workdir}/other-run"})

    def second_gpuhook(spec):
        spec["hooks"]["prestart"][1] = testbed.hook_entry(other)

    with Running(v2ns, bed, gpus, "v2-twice", env=["NVIDIA_VISIBLE_DEVICES=0"], hook_count=2,
                 edit=second_gpuhook) as box:
        assert box.started.returncode == 0, box.output
        (shown,) = box.show()["programs"]
        assert rules_of(shown) == planned_rules(gpus.sim, 0) + runc_rules
    first, second = gpus.log_lines()
    assert first["rules_added"] and second["rules_added"] == []


def test_read_only_grant_refuses_writes_and_revoke_restores_the_original_program(v2ns, bed, gpus):
    with Running(v2ns, bed, gpus, "v2-readonly") as box:
        assert box.started.returncode == 0, box.output
        (original,) = box.program_ids()
        box.mknod("/dev/ro-gpu", 195, 1)
        grant = v2.grant(box.cgroup_dir, [R("c 195:1 r")])
        assert list(grant) == [R("c 195:1 r")] and box.program_ids() != [original]
        probe = box.probe("/dev/ro-gpu")["/dev/ro-gpu"]
        assert (probe["read"], probe["write"]) == ("ENXIO", "EPERM")
        assert v2.revoke(box.cgroup_dir, grant) == []
        assert box.program_ids() == [original]
        probe = box.probe("/dev/ro-gpu")["/dev/ro-gpu"]
        assert (probe["read"], probe["write"]) == ("EPERM", "EPERM")


def test_swap_without_replace_attaches_then_detaches_and_leaves_one_program(v2ns, bed, gpus):
    with Running(v2ns, bed, gpus, "v2-noreplace") as box:
        assert box.started.returncode == 0, box.output
        (original,) = box.program_ids()
        grant = v2.grant(box.cgroup_dir, [R("c 195:0 rw")], use_replace=False)
        (swapped,) = box.program_ids()
        assert swapped == grant.swaps[0].new_id != original and grant.swaps[0].how == "attach, detach"
        assert v2.revoke(box.cgroup_dir, grant) == []
        assert box.program_ids() == [original]


def clobbering_r1(rules, original):
    """The pitfall from docs/runtime-facts.md §5: a prefix that uses r1 as its scratch
    register (as runc's own blocks do) leaves the old code a number where it expects the
    context pointer, and the verifier refuses the program."""
    scratch = {program.ALU | program.MOV | program.SRC_X, program.ALU | program.AND | program.SRC_K,
               program.JMP | program.JNE | program.SRC_X}
    return [insn._replace(dst=program.CONTEXT_REGISTER) if insn.code in scratch and insn.dst == program.R_SCRATCH
            else insn for insn in program.prepend(rules, original)]


def test_verifier_refusal_is_one_line_with_its_reason_and_the_original_stays(v2ns, bed, gpus):
    with Running(v2ns, bed, gpus, "v2-verifier") as box:
        assert box.started.returncode == 0, box.output
        before = box.program_ids()
        with pytest.raises(ApplyError) as caught:
            v2.grant(box.cgroup_dir, [R("c 195:0 rw")], build=clobbering_r1)
        line = caught.value.one_line()
        assert line.startswith("cgroup: the kernel's verifier refused the rebuilt device program")
        assert "R1" in line and "\n" not in line
        assert box.program_ids() == before


def test_missing_capability_is_one_line_and_changes_nothing(v2ns, bed, gpus):
    with Running(v2ns, bed, gpus, "v2-nocap") as box:
        assert box.started.returncode == 0, box.output
        before = box.program_ids()
        script = ("import sys; sys.path.insert(0, sys.argv[1]);"
                  "from gpuhook.apply.cgroup import v2; from gpuhook.devrules.devices import char_device;"
                  "from gpuhook.errors import ApplyError\n"
                  "try: v2.grant(sys.argv[2], [char_device(195, 0)])\n"
                  "except ApplyError as err: print(err.one_line()); sys.exit(5)\n")
        done = subprocess.run(["setpriv", "--bounding-set=-sys_admin,-bpf,-net_admin,-perfmon", "--inh-caps=-all",
                               "--", sys.executable, "-I", "-c", script, REPO, box.cgroup_dir],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 5, done.stderr
        (line,) = done.stdout.splitlines()
        assert "cannot list the device programs" in line and "Operation not permitted" in line
        assert "CAP_BPF" in line
        assert box.program_ids() == before


@contextlib.contextmanager
def jit_hardened():
    """net.core.bpf_jit_harden=2 (blind constants in every program) for the block, then back.
    The setting is global to the machine: keep the block short."""
    require(os.access(HARDEN, os.W_OK), f"needs a writable {HARDEN}")
    with open(HARDEN) as f:
        old = f.read().strip()
    with open(HARDEN, "w") as f:
        f.write("2")
    try:
        yield
    finally:
        with open(HARDEN, "w") as f:
            f.write(old)


def test_hardened_program_is_refused_in_one_line_and_the_original_stays(v2ns, bed, gpus):
    box = Running(v2ns, bed, gpus, "v2-hardened")
    with jit_hardened():
        box.start()  # runc loads the container's program hardened
    with box:
        assert box.started.returncode == 0, box.output
        before = box.program_ids()
        with pytest.raises(ApplyError) as caught:
            v2.grant(box.cgroup_dir, [R("c 195:0 rw")])
        line = caught.value.one_line()
        assert "is hardened" in line and "register 11" in line and "net.core.bpf_jit_harden to 1" in line
        assert box.program_ids() == before


def test_hook_fails_the_start_with_one_line_when_the_program_is_hardened(gpus):
    with jit_hardened():
        result = gpus.run(unique("v2-hardened-hook"), env=["NVIDIA_VISIBLE_DEVICES=0"])
    assert result.returncode != 0
    (line,) = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
    assert "cgroup: device program" in line and "is hardened" in line


def test_privileged_container_allowed_everything_is_left_alone(v2ns, bed, gpus):
    def allow_all(spec):
        spec["linux"]["resources"]["devices"] = [{"allow": True, "access": "rwm"}]

    with Running(v2ns, bed, gpus, "v2-priv", env=["NVIDIA_VISIBLE_DEVICES=0"], hook_count=1, edit=allow_all) as box:
        assert box.started.returncode == 0, box.output
        (shown,) = box.show()["programs"]
        assert shown["name"] != program.PROGRAM_NAME and rules_of(shown) == [R("a *:* rwm")]
    assert gpus.log_lines()[-1]["rules_added"] == []


def test_cgroup_without_device_program_needs_nothing(v2ns):
    empty = f"{v2ns.root}/sys/fs/cgroup/{unique('gpuhook-empty')}"
    os.mkdir(empty)
    try:
        grant = v2.grant(empty, [R("c 195:0 rw")])
        assert list(grant) == [] and grant.swaps == []
        assert v2.attached_programs(empty) == []
    finally:
        os.rmdir(empty)


@pytest.mark.parametrize("name", sorted(RULE_SETS))
def test_kernel_and_bpftool_read_our_programs_as_stored(name):
    require_root_tools("bpftool")
    fd = bpf.load(program.encode(program.prepend(RULE_SETS[name], program.DENY_ALL)), program.PROGRAM_NAME)
    try:
        prog_id = bpf.program_info(fd).id
        dump = subprocess.run(["bpftool", "prog", "dump", "xlated", "id", str(prog_id)],
                              capture_output=True, text=True, check=True).stdout
    finally:
        os.close(fd)
    assert dump.splitlines() == golden(name)


def test_cgroup_show_prints_the_rules_table_and_marks_ours(v2ns, bed, gpus, runc_rules):
    with Running(v2ns, bed, gpus, "v2-show", env=["NVIDIA_VISIBLE_DEVICES=0"], hook_count=1) as box:
        assert box.started.returncode == 0, box.output
        done = v2ns.run([sys.executable, "-m", "gpuhook", "cgroup", "show", "--pid", str(box.pid)])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("cgroup v2  /sys/fs/cgroup/") and f"(cgroup path {bed.cgroup_path(box.id)})" in lines[0]
    assert lines[1].startswith("program ") and "gpuhook_dev" in lines[1] and "attached here" in lines[1]
    rows = [line.split() for line in lines[3:-1]]
    assert [row[5] if len(row) > 5 else "" for row in rows] == ["gpuhook"] * 4 + [""] * len(runc_rules)
    assert rows[-1][:5] == [str(4 + len(runc_rules)), "deny", "a", "*:*", "rwm"]
    assert lines[-1] == f"systemd: the cgroup {bed.cgroup_path(box.id)} is not a scope of the system's systemd"


FAKE_SYSTEMCTL = r"""#!/bin/sh
# Stand-in for systemctl: logs its arguments; `show` prints the unit file $DIR/unit plus what
# set-property added ($DIR/added) and the unit's ControlGroup= from $DIR/cgroup.<unit> (the
# unit is the last argument); set-property fails with $DIR/refuse's text if that exists.
DIR=$(dirname "$0")
echo "$*" >> "$DIR/calls"
for last; do :; done
for arg; do case "$arg" in
  show) cat "$DIR/unit" "$DIR/added" 2>/dev/null
        printf 'ControlGroup=%s\n' "$(cat "$DIR/cgroup.$last" 2>/dev/null)"; exit 0 ;;
  set-property)
    if [ -f "$DIR/refuse" ]; then cat "$DIR/refuse" >&2; exit 1; fi
    for a; do case "$a" in DeviceAllow=*) echo "$a" >> "$DIR/added" ;; esac; done
    exit 0 ;;
esac; done
exit 2
"""


PROC_DEVICES = "Character devices:\n  1 mem\n136 pts\n195 nvidia-frontend\n509 nvidia-uvm\n\nBlock devices:\n  8 sd\n"


class FakeSystemd:
    """A Systemd wired to a stand-in systemctl, runtime dir, /dev and /proc/devices in a temp dir."""

    def __init__(self, tmp_path, unit_text="", running=True, control_groups=()):
        """`control_groups`: the cgroup paths of the units to answer ControlGroup= for (the
        unit is the path's last component), as systemd places them."""
        self.dir = tmp_path / "systemctl"
        self.dir.mkdir()
        (self.dir / "systemctl").write_text(FAKE_SYSTEMCTL)
        (self.dir / "systemctl").chmod(0o755)
        (self.dir / "unit").write_text(unit_text)
        for path in control_groups:
            (self.dir / f"cgroup.{path.rsplit('/', 1)[-1]}").write_text(path)
        runtime = tmp_path / "run-systemd-system"
        if running:
            runtime.mkdir()
        self.dev = tmp_path / "dev"
        self.dev.mkdir()
        (tmp_path / "devices").write_text(PROC_DEVICES)
        self.systemd = systemd.Systemd(systemctl=str(self.dir / "systemctl"), runtime_dir=str(runtime),
                                       dev_dir=str(self.dev), proc_devices=str(tmp_path / "devices"))

    def calls(self) -> list:
        try:
            return (self.dir / "calls").read_text().splitlines()
        except FileNotFoundError:
            return []

    def node(self, name, major, minor):
        os.mknod(self.dev / name, 0o20666, os.makedev(major, minor))


RUNC_SCOPE_UNIT = ("LoadState=loaded\nDevicePolicy=strict\nDeviceAllow=/dev/char/1:3 rwm\n"
                   "DeviceAllow=char-pts rwm\n")


GPU_RULES = [R("c 195:255 rw"), R("c 195:0 rw"), R("c 1:3 rw")]


SHOW = ("--no-pager --no-ask-password show --property=LoadState --property=DevicePolicy --property=DeviceAllow "
        "--property=ControlGroup -- ")


def test_scope_that_restricts_devices_gets_runtime_device_allow_for_what_it_lacks(tmp_path):
    require_root_tools()  # device nodes for the /dev/char links
    fake = FakeSystemd(tmp_path, RUNC_SCOPE_UNIT, control_groups=["/system.slice/docker-abc.scope"])
    fake.node("nvidia0", 195, 0)
    fake.node("nvidiactl", 195, 255)
    done = fake.systemd.register("/system.slice/docker-abc.scope", GPU_RULES)
    assert fake.calls() == [
        SHOW + "docker-abc.scope",
        "--no-pager --no-ask-password set-property --runtime -- docker-abc.scope "
        "DeviceAllow=/dev/char/195:255 rw DeviceAllow=/dev/char/195:0 rw",
    ]
    assert done.entries == ["/dev/char/195:255 rw", "/dev/char/195:0 rw"] and done.skipped is None
    assert sorted(done.links) == [f"{fake.dev}/char/195:0", f"{fake.dev}/char/195:255"]
    assert os.readlink(fake.dev / "char" / "195:0") == "../nvidia0"
    assert os.readlink(fake.dev / "char" / "195:255") == "../nvidiactl"


HOOK_SYSTEMCTL = r"""#!/bin/sh
# Stand-in systemctl bind-mounted over the real one in a private namespace: logs its
# arguments to LOG; `show` reports a scope that restricts devices, as runc's systemd driver
# leaves it, with the ControlGroup= systemd gives such a unit (the unit is the last argument:
# init.scope and session scopes where systemd keeps them, docker scopes in system.slice,
# any other scope at the top); set-property fails with REFUSE's text if that file exists.
echo "$*" >> LOG
for last; do :; done
case "$last" in
  init.scope) cgroup=/init.scope ;;
  session-*.scope) cgroup=/user.slice/user-0.slice/$last ;;
  docker-*.scope) cgroup=/system.slice/$last ;;
  *) cgroup=/$last ;;
esac
for arg; do case "$arg" in
  show) printf 'LoadState=loaded\nDevicePolicy=strict\nDeviceAllow=/dev/char/1:3 rwm\nDeviceAllow=char-pts rwm\n'
        printf 'ControlGroup=%s\n' "$cgroup"
        exit 0 ;;
  set-property) if [ -f REFUSE ]; then cat REFUSE >&2; exit 1; fi; exit 0 ;;
esac; done
exit 2
"""


@pytest.fixture
def systemd_host(tmp_path, sim_host, probe):
    """GPU containers in a namespace that looks like a systemd host to gpuhook: cgroup2 at
    /sys/fs/cgroup, /run/systemd/system present (on a tmpfs over /run, so the host's /run is
    untouched) and the stand-in over /usr/bin/systemctl."""
    from conftest import GpuContainers

    require_root_tools("unshare", "nsenter", "runc")
    require(os.path.isfile("/usr/bin/systemctl"), "needs /usr/bin/systemctl to mount the stand-in over")
    fake = tmp_path / "systemctl"
    fake.write_text(HOOK_SYSTEMCTL.replace("LOG", str(tmp_path / "calls")).replace("REFUSE", str(tmp_path / "refuse")))
    fake.chmod(0o755)
    setup = ("mount -t cgroup2 cgroup2 /sys/fs/cgroup && mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/system "
             f"&& mount --bind {fake} /usr/bin/systemctl && echo ready && exec sleep infinity")
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", setup],
                              stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=testbed.RUN_ENV)
    try:
        require(holder.stdout.readline() == b"ready\n", "cannot set up the systemd-like namespace")
        box = testbed.Testbed(str(tmp_path / "bed"), wrapper=Namespace(holder).wrapper)
        containers = GpuContainers(box, sim_host, probe, tmp_path)
        containers.calls = tmp_path / "calls"
        containers.refuse = tmp_path / "refuse"
        yield containers
    finally:
        holder.kill()
        holder.wait()


def scope_named(name):
    def edit(spec):
        # runc's cgroupfs driver with a path that ends in a scope, as the systemd driver makes.
        spec["linux"]["cgroupsPath"] = f"/{name}.scope"
    return edit


def test_hook_registers_the_granted_devices_with_the_containers_scope(systemd_host):
    name = unique("v2-scope")
    result = systemd_host.run(name, env=["NVIDIA_VISIBLE_DEVICES=0"], edit=scope_named(name))
    assert result.returncode == 0, result.stderr
    assert result.probes()["/dev/nvidia0"]["read"] == "ENXIO"
    entries = " ".join(f"DeviceAllow=/dev/char/{r.major}:{r.minor} rw" for r in planned_rules(systemd_host.sim, 0))
    assert systemd_host.calls.read_text().splitlines() == [
        SHOW + f"{name}.scope",
        f"--no-pager --no-ask-password set-property --runtime -- {name}.scope {entries}",
    ]


@pytest.mark.parametrize("unit", ["init.scope", "session-1.scope", "docker-{pid}-victim.scope"])
def test_hook_never_widens_a_unit_whose_name_a_cgroupfs_path_borrows(systemd_host, unit):
    """runc's cgroupfs driver with a cgroupsPath ending in another unit's name: systemd says
    that unit's cgroup is elsewhere, so gpuhook asks it nothing more (no set-property) and
    the container still gets its GPU through the cgroup it is really in."""
    name = unique(f"v2-borrowed-{unit.split('-')[0].split('.')[0]}")
    unit = unit.format(pid=os.getpid())

    def borrowed(spec):
        spec["linux"]["cgroupsPath"] = f"/{name}/{unit}"

    try:
        result = systemd_host.run(name, env=["NVIDIA_VISIBLE_DEVICES=0"], edit=borrowed)
    finally:  # runc removes the container's cgroup, not the parent it made for it
        subprocess.run([*systemd_host.bed.wrapper, "rmdir", f"/sys/fs/cgroup/{name}"], capture_output=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.probes()["/dev/nvidia0"]["read"] == "ENXIO"
    assert systemd_host.calls.read_text().splitlines() == [SHOW + unit]


def test_hook_fails_the_start_in_one_line_when_systemd_refuses(systemd_host):
    name = unique("v2-scope-refused")
    systemd_host.refuse.write_text(f"Failed to set unit properties on {name}.scope: Access denied\n")
    result = systemd_host.run(name, env=["NVIDIA_VISIBLE_DEVICES=0"], edit=scope_named(name))
    assert result.returncode != 0
    (line,) = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
    assert f"cgroup: systemd did not add DeviceAllow= to {name}.scope: Failed to set unit properties" in line
    assert [call.split()[2] for call in systemd_host.calls.read_text().splitlines()] == ["show", "set-property"]


def test_a_parent_cgroup_program_that_denies_the_gpu_fails_the_start_clearly(v2ns, bed, gpus):
    """gpuhook changes only the container's own programs; a deny above it (a parent cgroup's
    program, which also runs for every access) would leave the GPU giving EPERM while the
    start reported it injected. The start fails, naming the parent's program."""
    parent = unique("gpuhook-deny-parent")
    parent_dir = f"{v2ns.root}/sys/fs/cgroup/{parent}"
    os.mkdir(parent_dir)
    prog_fd = bpf.load(program.encode(program.prepend([R("c 1:3 rwm"), R("c 1:5 rwm"), R("c 136:* rwm"),
                                                       R("c 5:2 rwm"), R("c 1:9 rwm"), R("c 1:8 rwm")],
                                                      program.DENY_ALL)), "deny_gpu_test")
    cgroup_fd = os.open(parent_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        bpf.attach(cgroup_fd, prog_fd)

        def under_parent(spec):
            spec["linux"]["cgroupsPath"] = f"/{parent}/{unique('deny-child')}"

        result = gpus.run("deny-above", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=under_parent)
        assert result.returncode != 0
        (line,) = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
        assert "on a parent cgroup" in line and "denies c 195:" in line, line
    finally:
        try:
            bpf.detach(cgroup_fd, prog_fd)
        except OSError:
            pass
        os.close(cgroup_fd)
        os.close(prog_fd)
        for leftover in os.listdir(parent_dir):
            if os.path.isdir(f"{parent_dir}/{leftover}"):
                os.rmdir(f"{parent_dir}/{leftover}")
        os.rmdir(parent_dir)


# A prestart hook that plays another party: it attaches its own device program (allowing
# runc's defaults, denying everything else, GPUs included) to the container's cgroup.
FOREIGN_HOOK = r'''
import json, os, sys
sys.path.insert(0, sys.argv[1])
from gpuhook.apply.cgroup import bpf
from gpuhook.devrules import program
from gpuhook.devrules.devices import parse_v1_line as R
state = json.load(sys.stdin)
with open(f"/proc/{state['pid']}/cgroup") as f:
    (path,) = [line.split(":", 2)[2].strip() for line in f if line.startswith("0::")]
rules = [R(t) for t in ("c 1:3 rwm", "c 1:5 rwm", "c 136:* rwm", "c 5:2 rwm", "c 1:9 rwm", "c 1:8 rwm")]
prog = bpf.load(program.encode(program.prepend(rules, program.DENY_ALL)), "foreign_policy")
cgroup = os.open("/sys/fs/cgroup" + path, os.O_RDONLY | os.O_DIRECTORY)
bpf.attach(cgroup, prog)
with open(sys.argv[2], "w") as f:
    f.write(str(bpf.program_info(prog).id))
'''


def test_another_partys_program_on_the_cgroup_is_never_widened(v2ns, bed, gpus, tmp_path):
    """Only the runtime's program is the container's device policy gpuhook may widen. A
    second party's program on the same cgroup that denies the GPU is left exactly as it
    was, and the start fails naming it (before: gpuhook prepended its allows to it too)."""
    script = tmp_path / "foreign.py"
    script.write_text(FOREIGN_HOOK)
    written = tmp_path / "foreign.id"

    def foreign_first(spec):
        spec["hooks"]["prestart"].insert(0, {"path": sys.executable,
                                             "args": [sys.executable, str(script), REPO, str(written)]})

    result = gpus.run("foreign-prog", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=foreign_first)
    assert result.returncode != 0
    (line,) = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
    foreign_id = written.read_text()
    assert f"device program {foreign_id} (foreign_policy)" in line and "not attached by the runtime" in line, line
    assert "denies c 195:" in line, line


def test_cgroup_show_from_the_hosts_namespace_finds_the_v2_programs(v2ns, bed, gpus):
    """Run from the host's (hybrid) namespace for a container on v2, `cgroup show --pid` said
    "v1 root, allow all"; it now reads the container's v2 cgroup, where runc's
    program is."""
    with Running(v2ns, bed, gpus, "show-from-host") as box:
        assert box.started.returncode == 0, box.output
        done = subprocess.run([sys.executable, "-m", "gpuhook", "cgroup", "show", "--pid", str(box.pid), "--json"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        shown = json.loads(done.stdout)
        assert shown["mode"] == "v2" and len(shown["programs"]) == 1


def denied_after_allow_all(gpus, deny: dict, index: int):
    """Runtime rules `allow a *:* rwm` then `deny`, the image shipping a node for GPU `index`
    at /gpu outside the runtime's /dev: (rule editor, rootfs setup) for gpus.run."""
    nvidia, minor = gpus.sim["majors"]["nvidia"], gpus.sim["gpus"][index]["minor"]

    def edit(spec):
        spec["linux"]["resources"]["devices"] = [{"allow": True, "access": "rwm"}, {"allow": False, **deny}]

    def image_node(rootfs):
        os.mknod(rootfs + "/gpu", 0o666 | stat.S_IFCHR, os.makedev(nvidia, minor))

    return edit, image_node


def refused_line(result) -> str:
    assert result.returncode != 0 and "exit status 3" in result.stderr, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
    return line


def test_a_node_the_runtime_explicitly_denies_is_refused_never_granted(v2ns, bed, gpus):
    """Issue 23, G1 on pure v2: runc's program allows every device but GPU 0. A request for
    GPU 0 fails the start (exit 3, one line) instead of a program that opens it; a request
    for GPU 1 is served and GPU 0 stays shut."""
    nvidia, minor0 = gpus.sim["majors"]["nvidia"], gpus.sim["gpus"][0]["minor"]
    edit, image_gpu0 = denied_after_allow_all(gpus, {"type": "c", "major": nvidia, "minor": minor0,
                                                     "access": "rwm"}, 0)
    line = refused_line(gpus.run(unique("v2-denied-gpu0"), env=["NVIDIA_VISIBLE_DEVICES=0"], edit=edit,
                                 rootfs_setup=image_gpu0, paths=["/gpu"]))
    assert f"c {nvidia}:{minor0}" in line and "deny" in line, line
    result = gpus.run(unique("v2-denied-gpu0-asks-gpu1"), env=["NVIDIA_VISIBLE_DEVICES=1"], edit=edit,
                      rootfs_setup=image_gpu0, paths=["/gpu"])
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert p["/dev/nvidia1"]["read"] == "ENXIO" and p["/dev/nvidia1"]["write"] == "ENXIO", p["/dev/nvidia1"]
    assert not p["/dev/nvidia0"]["exists"]
    assert p["/gpu"]["read"] == "EPERM" and p["/gpu"]["write"] == "EPERM", p["/gpu"]


def test_a_deny_that_names_only_the_minor_is_explicit_too(v2ns, bed, gpus):
    """attack4 F1: `allow a *:* rwm; deny c *:<GPU 1's minor> rwm` denies GPU 1 by number. A
    request for GPU 1 is refused (exit 3), never a program that opens what runc shut."""
    minor1 = gpus.sim["gpus"][1]["minor"]
    edit, image_gpu1 = denied_after_allow_all(gpus, {"type": "c", "minor": minor1, "access": "rwm"}, 1)
    line = refused_line(gpus.run(unique("v2-denied-minor1"), env=["NVIDIA_VISIBLE_DEVICES=1"], edit=edit,
                                 rootfs_setup=image_gpu1, paths=["/gpu"]))
    # The first node the rule shuts is named: GPU 1, or a control node of that minor (nvidia-uvm-tools).
    assert f":{minor1} rw" in line and "device rules deny" in line, line


def test_a_gpu_granted_in_a_shared_cgroup_is_taken_back_from_the_program_at_poststop(v2ns, bed, gpus):
    """Attacker finding A06: on v2, Y (no GPU, no hook) and X (GPU 0 through gpuhook) share one
    cgroupsPath (runc before 1.2 only warns). gpuhook's program gave Y GPU 0 while X ran, and
    kept giving it after X was deleted: the v1 take-back had no v2 counterpart. Poststop now
    rebuilds the program without X's letters; runc's own rules behind them stay."""
    sim = gpus.sim
    path = f"/gpuhook-shared-{os.getpid()}"
    nvidia, gpu0 = sim["majors"]["nvidia"], sim["gpus"][0]["minor"]

    def shared(spec):
        spec["linux"]["cgroupsPath"] = path

    def hooked(spec):
        shared(spec)
        spec["hooks"] = {stage: [testbed.hook_entry(gpus.config, stage)] for stage in ("prestart", "poststop")}

    y = Running(v2ns, bed, gpus, "shared-y", edit=shared)
    x = Running(v2ns, bed, gpus, "shared-x", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=hooked)
    try:
        with y:
            assert y.started.returncode == 0, y.output
            y.mknod("/dev/g0", nvidia, gpu0)
            assert y.probe("/dev/g0")["/dev/g0"]["read"] == "EPERM"
            x.start()
            assert x.started.returncode == 0, x.output
            assert y.probe("/dev/g0")["/dev/g0"]["read"] == "ENXIO"  # the shared cgroup: Y has X's GPU while X runs
            bed.delete(x.id)
            probes = y.probe("/dev/g0", "/dev/null")
            assert probes["/dev/g0"]["read"] == "EPERM"
            assert probes["/dev/null"]["read"] == "OK"  # runc's own rules are still there
            (stop,) = [r for r in gpus.log_lines() if r.get("stage") == "poststop"]
            assert "took back" in stop["grants"], stop
    finally:
        bed.delete(x.id)
        v2ns.run(["rmdir", f"/sys/fs/cgroup{path}"])


def test_two_starts_at_once_in_one_cgroup_keep_each_others_gpu_and_leave_none_behind(v2ns, bed, gpus):
    """Attacker pass 7 (A9v2): X and Z (GPU 0 each) start at once in Y's cgroup; Z's hook finds
    GPU 0 allowed by X's program already and adds nothing. On v2 only a grant that added
    something was recorded, so X's stop took GPU 0 from the running Z. Every grant is
    recorded now: Z keeps GPU 0 until it stops, and then Y has none."""
    import threading
    import time

    sim = gpus.sim
    path = f"/gpuhook-at-once-{os.getpid()}"
    nvidia, gpu0 = sim["majors"]["nvidia"], sim["gpus"][0]["minor"]

    def shared(delay=0.0, hooked=True):
        def edit(spec):
            spec["linux"]["cgroupsPath"] = path
            if hooked:
                spec["hooks"] = {stage: [testbed.hook_entry(gpus.config, stage)] for stage in ("prestart", "poststop")}
                spec["hooks"]["prestart"].insert(0, {"path": "/bin/sleep", "args": ["sleep", str(delay)]})
        return edit

    y = Running(v2ns, bed, gpus, "at-once-y", edit=shared(hooked=False))
    x = Running(v2ns, bed, gpus, "at-once-x", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=shared(1))
    z = Running(v2ns, bed, gpus, "at-once-z", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=shared(1.5))
    try:
        with y:
            assert y.started.returncode == 0, y.output
            y.mknod("/dev/g0", nvidia, gpu0)
            starting = threading.Thread(target=x.start)
            starting.start()
            time.sleep(0.3)
            z.start()
            starting.join()
            assert x.started.returncode == 0 and z.started.returncode == 0, (x.output, z.output)
            bed.delete(x.id)
            assert z.probe("/dev/nvidia0")["/dev/nvidia0"]["read"] == "ENXIO"  # Z keeps its GPU
            bed.delete(z.id)
            assert y.probe("/dev/g0")["/dev/g0"]["read"] == "EPERM"  # and nothing is left for Y
    finally:
        bed.delete(x.id)
        bed.delete(z.id)
        v2ns.run(["rmdir", f"/sys/fs/cgroup{path}"])
