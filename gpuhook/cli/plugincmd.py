"""`gpuhook plugin`: the Kubernetes device plugin."""

import os
import stat
import sys

import click

from gpuhook import config as cfg
from gpuhook.cli import CONFIG_OPTION

DEFAULT_DIR = "/var/lib/kubelet/device-plugins"


@click.command(name="plugin", help=(
    "Run the Kubernetes device plugin (API v1beta1): advertise the GPUs (by UUID) with their "
    "health, re-checked every [plugin] recheck-seconds; check, clean and stamp them in "
    "PreStartContainer (registered as required); Allocate them through [plugin] strategy. "
    "Registers with kubelet again whenever kubelet restarts; SIGTERM or SIGINT stops it "
    "(exit 0). docs/device-plugin.md."))
@CONFIG_OPTION
@click.option("--device-plugin-dir", default=DEFAULT_DIR, show_default=True, metavar="DIR",
              help="kubelet's device plugin directory (kubelet.sock; the plugin's socket goes here).")
@click.option("--standalone", is_flag=True, help=(
    "No kubelet (podman, Docker): run only the health daemon, which keeps NVML loaded and "
    "checks and cleans GPUs for the hook over [health] daemon-socket. Under systemd "
    "(gpuhook-health.service, Type=notify) it reports READY=1 once that socket listens."))
def plugin(config_path, device_plugin_dir, standalone):
    config = cfg.load(config_path, os.environ)
    if standalone:
        import signal

        from gpuhook.health import daemon

        served = daemon.Daemon(config)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: served.stop.set())
        notify_when_listening(daemon.socket_path(config), served.stop)
        served.run()
        sys.exit(0)
    _check_plugin_installed()
    from gpuhook.plugin import server

    sys.exit(server.main(config, device_plugin_dir))


def _check_plugin_installed() -> None:
    """Say, in words that fit how this gpuhook was installed, what the device plugin lacks:
    its gRPC stubs are generated at build time in a checkout (scripts/setup) and in the
    Kubernetes image, but the deb and rpm do not ship them (docs/packaging.md)."""
    from gpuhook.errors import InputError

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.exists(os.path.join(package, "plugin", "generated", "deviceplugin_pb2_grpc.py")):
        checkout = os.path.dirname(package)
        if os.path.exists(os.path.join(checkout, "scripts", "setup")):
            raise InputError("the device plugin's gRPC stubs are missing",
                             f"run {checkout}/scripts/setup, which generates them")
        raise InputError("this gpuhook installation has no device plugin (the deb and rpm do not ship its gRPC "
                         "stubs)", "run the plugin from gpuhook's container image (deploy/kubernetes in gpuhook's "
                         "source); `gpuhook plugin --standalone`, the health daemon alone, works without it")
    try:
        import grpc  # noqa: F401
    except ImportError:
        raise InputError("the device plugin needs grpcio, which is not installed",
                         "install python3-grpcio (or: pip install grpcio)") from None


def notify_when_listening(path: str, stop, timeout: float = 120.0) -> None:
    """Under systemd (Type=notify, packaging/systemd/gpuhook-health.service), send READY=1
    once the daemon's socket at `path` listens: its NVML is loaded by then, so the units
    ordered after it (the container runtimes) start only when it can serve their first GPU
    starts. The socket is new when its inode differs from the one there now (a stale socket of
    a daemon that died is replaced). No NOTIFY_SOCKET: nothing to do."""
    target = os.environ.pop("NOTIFY_SOCKET", "")  # not inherited by the reset command's processes
    if not target:
        return
    import threading
    import time

    def old_inode():
        try:
            return os.lstat(path).st_ino
        except OSError:
            return None
    stale = old_inode()

    def wait_then_notify() -> None:
        end = time.monotonic() + timeout
        while not stop.is_set() and time.monotonic() < end:
            try:
                st = os.lstat(path)
                if stat.S_ISSOCK(st.st_mode) and st.st_ino != stale:
                    sd_notify(target, b"READY=1")
                    return
            except OSError:
                pass
            time.sleep(0.02)

    threading.Thread(target=wait_then_notify, name="gpuhook-notify", daemon=True).start()


def sd_notify(target: str, message: bytes) -> None:
    """One datagram to systemd's notification socket (sd_notify(3)): a path, or an abstract
    name written with a leading "@"."""
    import socket

    address = "\0" + target[1:] if target.startswith("@") else target
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.sendto(message, address)
        except OSError as err:
            print(f"gpuhook: cannot tell systemd the health daemon is ready: {err.strerror or err}", file=sys.stderr)
