"""A failure at each apply step aborts cleanly: the error names the step, the host keeps
nothing, and no child outlives the hook. (Issue 7, item 4.) The bpf, NVML and reset-command
faults live with their features (tests/integration/test_cgroup_v2.py, tests/*/test_health*.py)."""

import os
import time

import pytest

from conftest import LIBDIR, assert_rootfs_clean, fake_ldconfig, gpus_denied_parent, host_mounts

pytestmark = pytest.mark.root


def gpuhook_line(result) -> str:
    (line,) = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
    return line


def test_mknod_failure_names_the_node_and_undoes_everything(gpus):
    def dir_at_node(spec):  # a mount makes /dev/nvidia0 a directory before the hook runs
        spec["mounts"].append({"destination": "/dev/nvidia0", "type": "tmpfs", "source": "tmpfs"})

    before = host_mounts()
    result = gpus.run("fault-mknod", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=dir_at_node)
    assert result.returncode != 0
    line = gpuhook_line(result)
    assert "device node /dev/nvidia0" in line and "exists and is a directory" in line
    assert host_mounts() == before
    assert_rootfs_clean(result.rootfs)


def test_conflicting_device_from_the_spec_is_refused(gpus):
    def other_device(spec):
        spec["linux"].setdefault("devices", []).append(
            {"path": "/dev/nvidia0", "type": "c", "major": 1, "minor": 3, "fileMode": 438})

    result = gpus.run("fault-conflict", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=other_device)
    assert result.returncode != 0
    assert "exists and is a character device 1:3" in gpuhook_line(result)


def test_cgroup_write_failure_names_the_rule(gpus, tmp_path):
    """The container's parent cgroup denies major 195, so devices.allow refuses our rule."""
    with gpus_denied_parent("gpuhook-fault", "fault-cgroup") as under_parent:
        before = host_mounts()
        result = gpus.run("fault-cgroup", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=under_parent)
        assert result.returncode != 0
        line = gpuhook_line(result)
        assert "cgroup: cannot allow c 195:255 rw" in line and "Operation not permitted" in line
        assert host_mounts() == before
        assert_rootfs_clean(result.rootfs)


def test_a_failed_grant_puts_the_images_own_ld_cache_back(gpus):
    """The namespace worker runs while the hook grants the cgroup rules (gpuhook.apply.run): when
    the grant fails after the worker finished, even its last step (the image's ld.so.cache,
    replaced) is undone, byte for byte."""
    own_cache = b"the image's own ld.so.cache\n"
    with gpus_denied_parent("gpuhook-fault-cache", "fault-cgroup") as under_parent:
        def image_cache(rootfs):
            with open(f"{rootfs}/etc/ld.so.cache", "wb") as f:
                f.write(own_cache)

        before = host_mounts()
        result = gpus.run("fault-cgroup-cache", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=under_parent,
                          rootfs_setup=image_cache)
        assert result.returncode != 0
        assert "cgroup: cannot allow c 195:255 rw" in gpuhook_line(result)
        assert host_mounts() == before
        with open(f"{result.rootfs}/etc/ld.so.cache", "rb") as f:
            assert f.read() == own_cache
        assert sorted(os.listdir(f"{result.rootfs}/etc")) == ["ld.so.cache", "ld.so.conf"]
        assert not os.path.exists(result.rootfs + LIBDIR)


def test_a_replaced_ld_cache_leaves_no_copy_behind(gpus):
    def image_cache(rootfs):
        with open(f"{rootfs}/etc/ld.so.cache", "wb") as f:
            f.write(b"old")

    result = gpus.run("cache-replaced", env=["NVIDIA_VISIBLE_DEVICES=0"], rootfs_setup=image_cache)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(f"{result.rootfs}/etc")) == ["ld.so.cache", "ld.so.conf"]
    with open(f"{result.rootfs}/etc/ld.so.cache", "rb") as f:
        assert f.read() != b"old"


def processes_running(binary: str) -> list:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.readlink(f"/proc/{pid}/exe") == binary:
                    found.append(int(pid))
            except OSError:
                pass
    return found


def test_hanging_ldconfig_is_killed_at_the_deadline_with_its_children(gpus, tmp_path):
    hang = fake_ldconfig(tmp_path, "HANG")  # it forks a child that hangs too
    gpus.configure(ldconfig=hang, **{"deadline-seconds": 3})
    before = host_mounts()
    start = time.monotonic()
    result = gpus.run("fault-ldconfig", env=["NVIDIA_VISIBLE_DEVICES=0"])
    took = time.monotonic() - start
    assert result.returncode != 0
    line = gpuhook_line(result)
    assert "ldconfig" in line and "did not finish" in line
    assert took < 10, took  # the hook's own deadline, far below runc's hook timeout (30 s)
    time.sleep(0.2)
    assert processes_running(hang) == []
    assert host_mounts() == before
    assert_rootfs_clean(result.rootfs)


def test_failing_ldconfig_fails_the_start_and_its_output_goes_to_the_log_only(gpus, tmp_path):
    gpus.configure(ldconfig=fake_ldconfig(tmp_path, "FAIL"))
    result = gpus.run("fault-ldconfig-exit", env=["NVIDIA_VISIBLE_DEVICES=0"])
    assert result.returncode != 0
    line = gpuhook_line(result)
    assert "host ldconfig exited with 3" in line and "cannot do it" not in line
    assert gpus.log_lines()[-1]["detail"] == "ldconfig: cannot do it\n"
    assert_rootfs_clean(result.rootfs)


def test_a_dynamically_linked_or_script_ldconfig_is_refused(gpus, tmp_path):
    """In the container's root a dynamic ldconfig would load the image's loader, a script
    the image's shell: either would be image code running as root."""
    script = tmp_path / "ldconfig.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    for ldconfig, why in ((str(script), "not an ELF binary"), ("/bin/true", "dynamically linked")):
        gpus.configure(ldconfig=ldconfig)
        result = gpus.run("fault-ldconfig-kind", env=["NVIDIA_VISIBLE_DEVICES=0"])
        assert result.returncode != 0 and why in gpuhook_line(result)
        assert_rootfs_clean(result.rootfs)


def test_missing_host_ldconfig(gpus, tmp_path):
    gpus.configure(ldconfig=str(tmp_path / "nope"))
    result = gpus.run("fault-no-ldconfig", env=["NVIDIA_VISIBLE_DEVICES=0"])
    assert result.returncode != 0
    assert "host ldconfig" in gpuhook_line(result) and "No such file" in gpuhook_line(result)
    assert_rootfs_clean(result.rootfs)


def test_nvml_failure_fails_the_start_in_one_line_and_changes_nothing(bed, probe, tmp_path):
    """A damaged NVML (here: the simulated library's state file is garbage) during a start
    whose image has CUDA requirements and whose GPUs are health-checked."""
    from conftest import GpuContainers, require_root_tools
    from gpuhook.simulate import host as simhost
    from gpuhook.simulate import nvml as simnvml

    require_root_tools("gcc", "ldconfig")
    broken = simhost.build(str(tmp_path / "broken"), gpus=2)
    (tmp_path / "work").mkdir()
    containers = GpuContainers(bed, broken, probe, tmp_path / "work")
    with open(simnvml.state_path(broken["directory"]), "w") as f:
        f.write("{ this is not json")
    before = host_mounts()
    for name, env in (("nvml-requirements", ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda>=12.0"]),
                      ("nvml-health", ["NVIDIA_VISIBLE_DEVICES=1"])):
        result = containers.run(name, env=env)
        assert result.returncode != 0, name
        line = gpuhook_line(result)
        assert "NVML" in line, line
        assert host_mounts() == before
        assert_rootfs_clean(result.rootfs)


def test_cgroup_v1_undo_takes_back_only_the_access_gpuhook_added(tmp_path):
    """A container that could already read 195:0 keeps that when a failed start takes our
    'rw' grant back (the kernel merges both into one entry; only 'w' was ours)."""
    from gpuhook.apply.cgroup import v1
    from gpuhook.devrules.devices import char_device, parse_v1_line

    directory = f"/sys/fs/cgroup/devices/gpuhook-undo-{os.getpid()}"
    os.makedirs(directory)
    try:
        with open(f"{directory}/devices.deny", "w") as f:
            f.write("a *:* rwm")
        with open(f"{directory}/devices.allow", "w") as f:
            f.write("c 195:0 r")
        added = v1.grant(directory, [char_device(195, 0, "rw"), char_device(195, 1, "rw")])
        assert [r.v1_line() for r in added] == ["c 195:0 w", "c 195:1 rw"]
        assert sorted(r.v1_line() for r in v1.current_rules(directory)) == ["c 195:0 rw", "c 195:1 rw"]
        assert v1.revoke(directory, added) == []
        assert v1.current_rules(directory) == [parse_v1_line("c 195:0 r")]
    finally:
        os.rmdir(directory)


def test_a_failed_start_leaves_no_record_of_its_grant_or_of_being_served(gpus):
    """The served record is written while the worker works (gpuhook.apply.run): a start whose
    worker then fails takes it back, so no second hook entry skips it as served; the grant
    record is written only once a start is committed (tests/integration/test_grants.py says
    why), so a failed start has none."""
    def dir_at_node(spec):
        spec["mounts"].append({"destination": "/dev/nvidia0", "type": "tmpfs", "source": "tmpfs"})

    result = gpus.run("fault-records", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=dir_at_node)
    assert result.returncode != 0 and "exists and is a directory" in gpuhook_line(result)
    state_dir = f"{os.path.dirname(gpus.log)}/run"
    for kind in ("grants", "served"):
        names = os.listdir(f"{state_dir}/{kind}") if os.path.isdir(f"{state_dir}/{kind}") else []
        assert not [n for n in names if n.startswith("fault-records")], (kind, names)
    ok = gpus.run("fault-records-ok", env=["NVIDIA_VISIBLE_DEVICES=0"])  # the records are where this looks
    assert ok.returncode == 0, ok.stderr
    assert [n for n in os.listdir(f"{state_dir}/served") if n.startswith("fault-records-ok@")]
