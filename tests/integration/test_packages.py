"""The .deb and the .rpm (docs/packaging.md): generated files, builds, lintian, and the installed .deb.

SLOW, about half a minute: the tests marked `root` below build both packages from the working
tree (packaging/build-deb, packaging/build-rpm), run lintian, install the .deb on this machine
with dpkg, start podman containers with nothing but the installed files, then remove and
purge the package. CI runs them (scripts/test); to leave them out locally: `-k 'not packages'`.
They refuse to run (and fail under GPUHOOK_STRICT) where a gpuhook package is already
installed, and always purge the package they installed.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import pytest
from conftest import REPO, require, require_root_tools, sim_config_values
from helpers.runtimes import PodmanGpus, gpu_nodes, log_records, other_gpu_node, registered, wait_for_record
from gpuhook import __version__, config as cfg, install


RENDER = os.path.join(REPO, "packaging", "render.py")


# The oci-hooks files both packages install in /usr/share/containers/oci/hooks.d: name -> stage.
HOOKS_D_FILES = {"gpuhook.json": "prestart", "gpuhook-poststop.json": "poststop"}


VENDOR = os.path.join(REPO, "packaging", "vendor", "nvidia-ml-py")


SITE = "/usr/lib/python3/dist-packages"


CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def render(*args) -> str:
    return subprocess.run([sys.executable, RENDER, *args], capture_output=True, text=True, check=True).stdout


def run(*argv, check=True, timeout=300, **kwargs):
    kwargs.setdefault("env", CLEAN_ENV)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd="/", **kwargs)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def source_package_files() -> set:
    """Paths of gpuhook's package files in the source tree, relative to site-packages."""
    found = set()
    for base, dirs, files in os.walk(os.path.join(REPO, "gpuhook")):
        # The device plugin's gRPC stubs are generated in the tree (gitignored), not shipped
        # yet: Debian 12's grpcio-tools (1.14) is too old to build them (docs/device-plugin.md).
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "generated")]
        found |= {os.path.relpath(os.path.join(base, f), REPO) for f in files if not f.endswith(".pyc")}
    return found


# Installed path -> file in packaging/systemd: CDI spec regeneration (docs/cdi.md).
CDI_REFRESH_FILES = {
    "/usr/lib/systemd/system/gpuhook-cdi-refresh.service": "gpuhook-cdi-refresh.service",
    "/usr/lib/systemd/system/gpuhook-cdi-refresh.path": "gpuhook-cdi-refresh.path",
    "/usr/lib/udev/rules.d/71-gpuhook-cdi-refresh.rules": "71-gpuhook-cdi-refresh.rules",
}


# The health daemon (docs/packaging.md, "The health daemon"): enabled and started on install.
HEALTH_UNIT = "gpuhook-health.service"


# The agent (docs/packaging.md, "The agent"): runs the hook for the native front; enabled too.
AGENT_UNIT = "gpuhook-agent.service"


SYSTEMD_FILES = {**CDI_REFRESH_FILES, f"/usr/lib/systemd/system/{HEALTH_UNIT}": HEALTH_UNIT,
                 f"/usr/lib/systemd/system/{AGENT_UNIT}": AGENT_UNIT}


def check_front(path) -> None:
    """The packaged native front: an executable that speaks this gpuhook's front protocol."""
    from gpuhook.prescan import FRONT_PROTOCOL

    assert os.stat(path).st_mode & 0o777 == 0o755
    assert run(str(path), "--protocol").stdout == f"{FRONT_PROTOCOL}\n"


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """Both packages, built once from the working tree: {"deb": path, "rpm": path}."""
    require_root_tools("dpkg-buildpackage", "dh_python3", "rpmbuild", "lintian")
    out = tmp_path_factory.mktemp("packages")
    built = {}
    for script, kind in (("build-deb", "deb"), ("build-rpm", "rpm")):
        done = run(os.path.join(REPO, "packaging", script), str(out))
        (built[kind],) = [p for p in done.stdout.split() if p.endswith(f".{kind}")]
    return built


@pytest.mark.root
def test_deb_holds_the_whole_package_the_generated_files_and_pynvml(packages, tmp_path):
    run("dpkg-deb", "-x", packages["deb"], str(tmp_path))
    installed = {os.path.relpath(os.path.join(b, f), f"{tmp_path}{SITE}")
                 for b, _, files in os.walk(f"{tmp_path}{SITE}/gpuhook") for f in files}
    assert source_package_files() <= installed | {"gpuhook/_vendor/pynvml.py"}
    with open(f"{tmp_path}{SITE}/gpuhook/_vendor/pynvml.py", "rb") as f, open(f"{VENDOR}/pynvml.py", "rb") as g:
        assert f.read() == g.read()
    assert sorted(os.listdir(f"{tmp_path}/usr/share/containers/oci/hooks.d")) == sorted(HOOKS_D_FILES)
    # The front: static-pie (no program interpreter, no shared library), position-independent.
    headers = run("readelf", "-lhd", f"{tmp_path}/usr/libexec/gpuhook/gpuhook-front").stdout
    assert "DYN (" in headers and "INTERP" not in headers and "NEEDED" not in headers
    for name in HOOKS_D_FILES:  # one file per stage, each exactly what the repository holds
        with open(f"{tmp_path}/usr/share/containers/oci/hooks.d/{name}") as f, \
                open(os.path.join(REPO, "hooks.d", name)) as g:
            assert f.read() == g.read(), name
    with open(f"{tmp_path}/etc/gpuhook/config.toml") as f:
        assert f.read() == render("config")
    for path in ("/usr/bin/gpuhook", "/usr/share/man/man1/gpuhook.1.gz"):
        assert os.path.exists(tmp_path / path.lstrip("/")), path
    check_front(tmp_path / install.PACKAGED_FRONT.lstrip("/"))
    for name in ("gpuhook-annotated.json", "gpuhook-poststop-annotated.json"):
        with open(f"{tmp_path}/usr/share/doc/gpuhook/examples/{name}") as f, \
                open(os.path.join(REPO, "hooks.d", name)) as g:
            assert f.read() == g.read(), name
    with open(f"{tmp_path}/usr/share/doc/gpuhook/copyright") as f:
        copyright_text = f.read()
    assert "License: BSD-3-clause" in copyright_text and "NVIDIA Corporation" in copyright_text

    for path, name in SYSTEMD_FILES.items():  # CDI spec regeneration, the health daemon, byte for byte
        path = path.replace("/usr/lib/", "/lib/")  # Debian 12's debhelper: units and rules in /lib
        with open(tmp_path / path.lstrip("/")) as f, open(os.path.join(REPO, "packaging", "systemd", name)) as g:
            assert f.read() == g.read(), path
    postinst = run("dpkg-deb", "--info", packages["deb"], "postinst").stdout
    assert "gpuhook-cdi-refresh.path" in postinst  # dh_installsystemd enables the path unit
    # ... and enables the health daemon, starts it on install, restarts it on upgrade; stops it
    # before removal and forgets it on purge.
    assert f"deb-systemd-helper enable '{HEALTH_UNIT}'" in postinst
    assert f"deb-systemd-helper enable '{AGENT_UNIT}'" in postinst
    (invoke,) = [line for line in postinst.splitlines() if "deb-systemd-invoke $_dh_action" in line]
    assert f"'{HEALTH_UNIT}'" in invoke and "_dh_action=start" in postinst and "_dh_action=restart" in postinst
    (stop,) = [line for line in run("dpkg-deb", "--info", packages["deb"], "prerm").stdout.splitlines()
               if "deb-systemd-invoke stop" in line]
    assert f"'{HEALTH_UNIT}'" in stop
    assert f"'{HEALTH_UNIT}'" in run("dpkg-deb", "--info", packages["deb"], "postrm").stdout

    fields = run("dpkg-deb", "--field", packages["deb"], "Version", "Depends", "Architecture", "Built-Using").stdout
    # Architecture-specific: the native front is compiled (docs/packaging.md).
    arch = run("dpkg", "--print-architecture").stdout.strip()
    assert f"Version: {__version__}" in fields and f"Architecture: {arch}" in fields
    # The front is static-pie: it needs no libc6 at run time, and names the glibc it carries.
    assert "libc6" not in fields.split("Built-Using:")[0]
    glibc = run("dpkg-query", "-f", "${source:Version}", "-W", "libc6-dev").stdout
    assert f"Built-Using: glibc (= {glibc})" in fields
    for dependency in ("python3 (>= 3.11)", "python3-click", "python3-jsonschema", "python3-yaml"):
        assert dependency in fields
    assert "psutil" not in fields  # a test oracle only (README, "Why not psutil")
    assert sorted(run("dpkg-deb", "--info", packages["deb"], "conffiles").stdout.split()) == \
        ["/etc/gpuhook/config.toml", "/etc/logrotate.d/gpuhook"]
    with open(tmp_path / "etc/logrotate.d/gpuhook") as f, \
            open(os.path.join(REPO, "packaging", "deb", "debian", "gpuhook.logrotate")) as g:
        assert f.read() == g.read()


@pytest.mark.root
def test_lintian_reports_no_errors(packages):
    done = run("lintian", "--no-tag-display-limit", packages["deb"], check=False)
    errors = [line for line in done.stdout.splitlines() if line.startswith("E:")]
    assert errors == [], done.stdout
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.root
def test_rpm_holds_the_package_its_config_and_dependencies(packages, tmp_path):
    files = set(run("rpm", "-qpl", packages["rpm"]).stdout.split())
    site = next(p for p in files if p.endswith("/gpuhook/launch.py")).rsplit("/gpuhook/", 1)[0]
    for path in source_package_files():
        assert f"{site}/{path}" in files, path
    assert f"{site}/gpuhook/_vendor/pynvml.py" in files
    assert {"/usr/bin/gpuhook", "/etc/gpuhook/config.toml", install.PACKAGED_FRONT} <= files
    assert {p for p in files if p.startswith("/usr/share/containers/oci/hooks.d/")} == \
        {f"/usr/share/containers/oci/hooks.d/{name}" for name in HOOKS_D_FILES}
    # The directories belong to containers-common (podman, CRI-O), not to gpuhook.
    assert not files & {"/usr/share/containers", "/usr/share/containers/oci", "/usr/share/containers/oci/hooks.d"}
    assert any(p.endswith("/gpuhook-poststop-annotated.json") for p in files)  # the documented example
    assert any(p.startswith(f"{site}/gpuhook/__pycache__/entry.") for p in files)  # byte-compiled
    assert set(SYSTEMD_FILES) <= files
    assert sorted(run("rpm", "-qpc", packages["rpm"]).stdout.split()) == \
        ["/etc/gpuhook/config.toml", "/etc/logrotate.d/gpuhook"]
    # One package for RHEL 9 and Fedora: it needs their python3.11 and nothing else of Python's.
    requires = set(run("rpm", "-qpR", packages["rpm"]).stdout.splitlines())
    # Nothing for the native front: it is static-pie (native/build.py).
    assert not {r for r in requires if r.startswith("libc.so")}
    assert {r for r in requires if not r.startswith(("rpmlib(", "rtld("))} == \
        {"/bin/sh", "/usr/bin/python3.11", "logrotate", f"config(gpuhook) = {__version__}-1"}
    assert run("rpm", "-qp", "--recommends", packages["rpm"]).stdout.split() == ["python3.11-pyyaml"]
    provides = run("rpm", "-qp", "--provides", packages["rpm"]).stdout.splitlines()
    assert "bundled(python3dist(click)) = 8.1.7" in provides
    assert any(p.startswith("bundled(python3dist(nvidia-ml-py))") for p in provides)
    assert run("rpm", "-qp", "--queryformat", "%{VERSION}", packages["rpm"]).stdout == __version__

    payload = tmp_path / "payload.tar.gz"
    with open(packages["rpm"], "rb") as rpm_file, open(payload, "wb") as out:
        subprocess.run(["rpm2archive", "-"], stdin=rpm_file, stdout=out, check=True)
    run("tar", "-xzf", str(payload), "-C", str(tmp_path))
    for name, stage in HOOKS_D_FILES.items():
        with open(tmp_path / "usr/share/containers/oci/hooks.d" / name) as f:
            doc = json.load(f)
        assert doc["stages"] == [stage] and doc["when"] == {"always": True}, name
        assert doc["hook"]["path"] == install.PACKAGED_FRONT  # which runs the Python command after it
        assert doc["hook"]["args"][:2] == [install.PACKAGED_FRONT, "/usr/bin/python3.11"], name
        assert doc["hook"]["args"][4:] == [f"{site}/gpuhook/launch.py", stage], name
    check_front(tmp_path / install.PACKAGED_FRONT.lstrip("/"))
    assert site == "/usr/lib/python3.11/site-packages"
    with open(tmp_path / "usr/lib/systemd/system-preset/50-gpuhook.preset") as f:
        preset = f.read().splitlines()
    assert "enable gpuhook-cdi-refresh.path" in preset and f"enable {HEALTH_UNIT}" in preset
    assert f"enable {AGENT_UNIT}" in preset
    for unit in (HEALTH_UNIT, AGENT_UNIT):
        with open(tmp_path / f"usr/lib/systemd/system/{unit}") as f, \
                open(os.path.join(REPO, "packaging", "systemd", unit)) as g:
            assert f.read() == g.read()


def scriptlet(scripts: str, name: str) -> str:
    """The body of one scriptlet in `rpm -qp --scripts` output."""
    body = scripts.partition(f"{name} scriptlet (using /bin/sh):\n")[2]
    return re.split(r"(?m)^\w+ scriptlet \(using", body)[0]


@pytest.mark.root
def test_rpm_scriptlets_hand_the_units_to_systemd_as_its_rpm_macros_do(packages):
    """%systemd_post, %systemd_preun, %systemd_postun(_with_restart): systemd-update-helper
    presets the units on first install (the package's preset enables them), disables them on
    erase, reloads and restarts the health daemon and the agent on upgrade. The units started by
    the scriptlets themselves are the health daemon and the agent, on a first install, and only
    when the presets left them enabled (an admin's preset that disables one wins); nothing is
    enabled by hand."""
    scripts = run("rpm", "-qp", "--scripts", packages["rpm"]).stdout
    post = scriptlet(scripts, "postinstall")
    units = f"gpuhook-cdi-refresh.path {HEALTH_UNIT} {AGENT_UNIT}"
    assert f"systemd-update-helper install-system-units {units}" in post
    assert f"systemd-update-helper remove-system-units {units}" in scriptlet(scripts, "preuninstall")
    postun = scriptlet(scripts, "postuninstall")
    assert "systemd-update-helper system-reload" in postun
    assert f"systemd-update-helper mark-restart-system-units {HEALTH_UNIT} {AGENT_UNIT}" in postun
    assert f"for unit in {HEALTH_UNIT} {AGENT_UNIT}; do" in post
    calls = [line.strip() for line in scripts.splitlines() if "systemctl" in line]
    assert calls == ["if [ $1 -eq 1 ] && [ -d /run/systemd/system ] && systemctl --quiet is-enabled $unit "
                     "2>/dev/null; then", "systemctl --no-block start $unit || :"]


def dpkg_status(package: str = "gpuhook") -> str:
    return run("dpkg-query", "-W", "-f", "${Status}", package, check=False).stdout


@pytest.fixture
def installed_deb(packages):
    """The .deb installed with dpkg (apt-get -f install fetches missing dependencies); the
    package is purged and directories the test made in /etc are removed afterwards."""
    require_root_tools("dpkg", "apt-get", "podman")
    require(dpkg_status() in ("", "unknown ok not-installed"), "a gpuhook package is already installed here")
    admin_dir_existed = os.path.isdir(install.ADMIN_HOOKS_DIR)
    try:
        if run("dpkg", "-i", packages["deb"], check=False).returncode != 0:
            run("apt-get", "-f", "install", "-y", "-q", env={**CLEAN_ENV, "DEBIAN_FRONTEND": "noninteractive"})
        assert dpkg_status() == "install ok installed"
        yield packages["deb"]
    finally:
        run("dpkg", "--purge", "gpuhook", check=False)
        if not admin_dir_existed:
            for path in (install.ADMIN_HOOKS_DIR, os.path.dirname(install.ADMIN_HOOKS_DIR)):
                if os.path.isdir(path) and not os.listdir(path):
                    os.rmdir(path)


@pytest.mark.root
def test_installed_deb_runs_podman_containers_and_removes_cleanly(installed_deb, bed, sim_host, probe, tmp_path):
    # The command and the package come from the installed files, not from this tree.
    assert run("/usr/bin/gpuhook", "--version").stdout.strip() == f"gpuhook, version {__version__}"
    where = run("/usr/bin/python3", "-c", "import gpuhook, gpuhook._vendor.pynvml as p; print(gpuhook.__file__, p.__file__)")
    assert where.stdout.split() == [f"{SITE}/gpuhook/__init__.py", f"{SITE}/gpuhook/_vendor/pynvml.py"]
    assert os.path.exists(f"{SITE}/gpuhook/__pycache__/entry.cpython-{sys.version_info[0]}{sys.version_info[1]}.pyc")
    # The deb ships no device plugin stubs: the error says what a deb user can do, and names
    # no source-tree path or tool (scripts/setup, build_stubs.py) the package does not have.
    plugin = run("/usr/bin/gpuhook", "plugin", "--device-plugin-dir", str(tmp_path / "device-plugins"), check=False)
    assert plugin.returncode == 2 and plugin.stderr.count("\n") == 1, plugin.stderr
    assert plugin.stderr.startswith("gpuhook: this gpuhook installation has no device plugin"), plugin.stderr
    assert "gpuhook plugin --standalone" in plugin.stderr
    assert "scripts/setup" not in plugin.stderr and "build_stubs" not in plugin.stderr

    # The packaged hooks.d files read the packaged /etc/gpuhook/config.toml: point it at the
    # simulated host (this also makes it a modified conffile for the removal check below).
    gpus = PodmanGpus(bed, sim_host, probe, tmp_path, install.PACKAGE_HOOKS_DIR)
    try:
        addition = "\n".join(f"{k} = {json.dumps(v)}" for k, v in sim_config_values(sim_host, gpus.log).items())
        with open(cfg.DEFAULT_PATH, "a") as f:
            f.write(f"\n# test_packages: the simulated host\n{addition}\n")
        shown = json.loads(run("/usr/bin/gpuhook", "config", "--json").stdout)
        assert shown["source"] == cfg.DEFAULT_PATH and shown["values"]["log-file"] == gpus.log

        # The health daemon as installed: enabled for boot, and its unit's ExecStart (the
        # installed /usr/bin/gpuhook, the packaged config) serves the packaged hook, which then
        # loads no NVML (this machine runs no systemd: the test starts what the unit starts).
        assert os.path.realpath(f"/etc/systemd/system/multi-user.target.wants/{HEALTH_UNIT}") == \
            os.path.realpath(f"/lib/systemd/system/{HEALTH_UNIT}")
        with open(f"/lib/systemd/system/{HEALTH_UNIT}") as f:
            (exec_start,) = [line.split("=", 1)[1].split() for line in f if line.startswith("ExecStart=")]
        daemon = start_notify_service(exec_start, tmp_path)
        try:
            result = gpus.run("deb-gpu1", env=["NVIDIA_VISIBLE_DEVICES=1"], before=other_gpu_node(0),
                              paths=["/dev/other-gpu"])
        finally:
            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(timeout=15) == 0
        assert result.returncode == 0, result.stderr
        p = result.probes()
        assert gpu_nodes(p) == {"/dev/nvidia1"} and p["/dev/nvidia1"]["read"] == "ENXIO"
        assert p["/dev/other-gpu"]["read"] == "EPERM"
        (start,) = log_records(gpus, "prestart")
        assert start["health"]["daemon"] == "prepared by the health daemon" and start["nvml"] == "not loaded"
        # The packaged poststop file: podman runs it when it removes the stopped container.
        assert wait_for_record(gpus, "poststop", start["container"])["decision"] == "cleaned up"
        assert not registered(gpus, start["container"])
        result = gpus.run("deb-plain")
        assert result.returncode == 0, result.stderr
        assert not any(item["exists"] for path, item in result.probes().items() if path.startswith("/dev/nvidia"))
        assert gpus.podman.wait_until_idle()
        lines = gpus.log_lines()
        assert [(line["stage"], line["decision"]) for line in lines if line["stage"] != "prepare"] == \
            [("prestart", "gpus injected"), ("poststop", "cleaned up")]
        assert [line["stage"] for line in lines].count("prepare") == 1  # the daemon's, for that start
    finally:
        gpus.podman.close()

    # gpuhook install from the package registers exactly what the package ships, both stages.
    admin_files = [f"{install.ADMIN_HOOKS_DIR}/{name}" for name in HOOKS_D_FILES]
    packaged_files = [f"{install.PACKAGE_HOOKS_DIR}/{name}" for name in HOOKS_D_FILES]
    run("/usr/bin/gpuhook", "install", "podman")
    for admin_file, packaged_file in zip(admin_files, packaged_files):
        with open(admin_file) as f, open(packaged_file) as g:
            assert f.read() == g.read(), admin_file

    with open(cfg.DEFAULT_PATH) as f:
        modified = f.read()
    removal = run("dpkg", "-r", "gpuhook")
    assert dpkg_status() == "deinstall ok config-files"
    for admin_file in admin_files:  # taken back by the prerm
        assert f"gpuhook: removed {admin_file}\n" in removal.stderr, removal.stderr
    for gone in (*admin_files, *packaged_files, "/usr/bin/gpuhook", f"{SITE}/gpuhook"):
        assert not os.path.exists(gone), gone
    with open(cfg.DEFAULT_PATH) as f:
        assert f.read() == modified  # a conffile: kept, changes and all

    # Purge removes the default state dir too. Run in a mount namespace of its own with a tmpfs
    # on /run, holding what the packaged hook leaves there, so the host's /run is not touched.
    purge = ("mount -t tmpfs tmpfs /run && mkdir -p /run/gpuhook/config-cache && "
             "touch /run/gpuhook/config-cache/%etc%gpuhook%config.toml.json /run/gpuhook/inventory.json && "
             "dpkg --purge gpuhook >/dev/null && ls -A /run")
    left = run("unshare", "--mount", "--propagation", "private", "sh", "-ec", purge).stdout.split()
    assert "gpuhook" not in left
    assert dpkg_status() in ("", "unknown ok not-installed") and not os.path.exists(os.path.dirname(cfg.DEFAULT_PATH))
    # The hook wrote its parsed config's cache under the state-dir its config names, not in /run/gpuhook.
    assert os.path.isdir(f"{os.path.dirname(gpus.log)}/run/config-cache")
    assert not os.path.lexists(f"/etc/systemd/system/multi-user.target.wants/{HEALTH_UNIT}")


def start_notify_service(argv: list, tmp_path) -> subprocess.Popen:
    """Start `argv` as systemd starts a Type=notify service (NOTIFY_SOCKET, a clean
    environment); returns once it sent READY=1."""
    path = f"{tmp_path}/notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(path)
        notify.settimeout(60)
        served = subprocess.Popen(argv, cwd="/", env={**CLEAN_ENV, "NOTIFY_SOCKET": path},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert notify.recv(4096) == b"READY=1"
        except BaseException:
            served.kill()
            served.wait()
            raise
    return served


CHECK_REPO_DEPS = os.path.join(REPO, "packaging", "rpm", "check-repo-deps")


REPO_DATA = os.path.join(REPO, "tests", "data", "rpm-repodata")


RPMLINTRC = os.path.join(REPO, "packaging", "rpm", "gpuhook.rpmlintrc")


@pytest.mark.root
def test_rpmlint_finds_nothing_beyond_the_reviewed_filters(packages):
    require_root_tools("rpmlint")
    done = run("rpmlint", "-r", RPMLINTRC, packages["rpm"],
               os.path.join(REPO, "packaging", "rpm", "gpuhook.spec"), check=False)
    assert "0 errors, 0 warnings" in done.stdout, done.stdout
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.root
@pytest.mark.parametrize("distro,pyyaml", [("el9", "python3.11-pyyaml-6.0.1-1.el9"),
                                           ("fedora", "not available, skipped")])
def test_the_rpm_resolves_against_repository_metadata_of_rhel9_and_fedora(packages, distro, pyyaml):
    """packaging/rpm/check-repo-deps against metadata excerpts (tests/data/rpm-repodata): the
    tool the docs give for the real repositories, which are not reachable from here."""
    done = run(CHECK_REPO_DEPS, "--repo", f"{REPO_DATA}/{distro}", packages["rpm"], check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"(recommends) python3.11-pyyaml: {pyyaml}" in done.stdout


@pytest.mark.root
def test_the_rpm_runs_on_python311_with_bundled_click_and_nothing_else(packages, tmp_path):
    # The payload as RHEL 9's python3.11 would run it: its own site-packages and nothing else
    # (no click, jsonschema or pynvml from anywhere but the package).
    payload = tmp_path / "payload"
    payload.mkdir()
    with open(packages["rpm"], "rb") as rpm_file:
        archive = subprocess.run(["rpm2archive", "-"], stdin=rpm_file, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-xz", "-C", str(payload)], input=archive, check=True)
    site = f"{payload}/usr/lib/python3.11/site-packages"
    with open(payload / "usr/share/containers/oci/hooks.d/gpuhook.json") as f:
        assert json.load(f)["hook"]["args"][:5] == [install.PACKAGED_FRONT, "/usr/bin/python3.11", "-I", "-S",
                                                     "/usr/lib/python3.11/site-packages/gpuhook/launch.py"]
    only_the_package = "import sys; sys.path[:] = [p for p in sys.path if 'packages' not in p] + [sys.argv.pop(1)]; "
    python311 = [shutil.which("python3.11"), "-I", "-c"]
    run_script = only_the_package + "import runpy; sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name='__main__')"
    gpuhook = [*python311, run_script, site, f"{payload}/usr/bin/gpuhook"]
    assert run(*gpuhook, "--version").stdout.strip() == f"gpuhook, version {__version__}"
    state = os.path.join(REPO, "examples", "states", "runc-no-gpu.json")
    dry = run(*gpuhook, "prestart", "--dry-run", "--state", state)
    assert "state not checked against the OCI schema: jsonschema is not installed" in dry.stdout
    which = only_the_package + ("import gpuhook._vendor as v, gpuhook._vendor.pynvml as p; v.add_bundled_site(); "
                                "import click; print(click.__file__, p.__file__)")
    assert run(*python311, which, site).stdout.split() == \
        [f"{site}/gpuhook/_vendor/site/click/__init__.py", f"{site}/gpuhook/_vendor/pynvml.py"]


@pytest.mark.root
def test_fedoras_native_build_asks_for_fedoras_python_and_would_not_resolve_on_rhel9(tmp_path):
    # As rpmbuild on Fedora makes it (%{fedora} defined; Fedora 41's site-packages path, so rpm's
    # generators write the python(abi) and python3.13dist() requirements a Fedora build has).
    # Only the metadata is Fedora's (the byte code is this host's Python): a dependency check,
    # not a package to ship. It also shows that check-repo-deps can fail.
    require_root_tools("rpmbuild")
    (rpm_file,) = run(os.path.join(REPO, "packaging", "build-rpm"), "--define", "fedora 41", "--define",
                      "python3_sitelib /usr/lib/python3.13/site-packages", str(tmp_path)).stdout.split()
    requires = run("rpm", "-qpR", rpm_file).stdout.splitlines()
    assert {"python(abi) = 3.13", "python3.13dist(click) >= 8.1", "python3 >= 3.11"} <= set(requires)
    done = run(CHECK_REPO_DEPS, "--repo", f"{REPO_DATA}/fedora", rpm_file, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    done = run(CHECK_REPO_DEPS, "--repo", f"{REPO_DATA}/el9", rpm_file, check=False)
    assert done.returncode == 1
    assert "python3 >= 3.11: NOTHING PROVIDES IT" in done.stdout and "python3-click: NOTHING PROVIDES IT" in done.stdout
