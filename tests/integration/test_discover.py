"""Host discovery from files: /proc/driver/nvidia, /proc/devices, the driver root."""

import os
from gpuhook import config as cfg
from gpuhook.discover import driverfiles, inventory, survey


def test_simulated_host_is_discovered_completely(sim_host):
    c = cfg.load(sim_host["config"])
    inv = inventory.scan(c)
    assert inv.driver_version == sim_host["driver_version"]
    assert [g.uuid for g in inv.gpus] == [g["uuid"] for g in sim_host["gpus"]]
    caps = {lib.capability for lib in inv.libraries}
    assert caps == {"utility", "compute", "video", "graphics", "ngx"}
    cuda = next(lib for lib in inv.libraries if lib.file_name.startswith("libcuda.so."))
    assert cuda.sonames == ("libcuda.so.1", "libcuda.so") and os.path.isfile(cuda.host_path)
    assert cuda.host_path.startswith(sim_host["directory"] + "/driver/")
    assert {b.container_path for b in inv.binaries} >= {"/usr/bin/nvidia-smi", "/usr/bin/nvidia-cuda-mps-server"}
    assert len(inv.firmware) == 2 and inv.ipc[0].kind == "socket"
    assert survey.host_node(c, "/dev/nvidia0") == (0o666, 0, 0, f"{sim_host['directory']}/dev/nvidia0")
    assert survey.host_node(c, "/dev/nvidia9") is None


def test_driver_root_symlinks_stay_inside_the_root(tmp_path, sim_host):
    """A cache entry whose link points outside the driver root is skipped, not followed."""
    import shutil

    root = tmp_path / "driver"
    shutil.copytree(f"{sim_host['directory']}/driver", root, symlinks=True, ignore=shutil.ignore_patterns("socket"))
    libdir = root / "usr/lib/x86_64-linux-gnu"
    (libdir / "libcuda.so.1").unlink()
    (libdir / "libcuda.so.1").symlink_to("/etc/passwd")  # absolute: means <root>/etc/passwd
    libs = driverfiles.libraries(str(root))
    assert not any(lib.host_path.startswith("/etc/") for lib in libs)
    assert all(lib.host_path.startswith(str(root) + "/") for lib in libs)
