"""`gpuhook demo`: a real runc container gets two simulated GPUs from gpuhook, and shows it."""

import json
import os
import shutil
import tempfile

import click

from gpuhook.driver import DEFAULT_CAPABILITIES
from gpuhook.simulate import demo as runc
from gpuhook.simulate import host

SCRIPT = r"""
echo "--- NVIDIA device nodes in the container's /dev"
ls -l /dev | grep nvidia
echo "--- nvidia-smi (simulated; reports what open(2) says for each node)"
/usr/bin/nvidia-smi
{not_mine}echo "--- driver libraries mounted read-only (first lines of $(ls {libdir} | wc -l) entries in {libdir})"
ls -l {libdir} | head -6
echo "    mount of libcuda: $(grep ' {libdir}/libcuda.so' /proc/self/mountinfo | cut -d' ' -f5,6)"
"""
NOT_MINE = r"""echo "--- a GPU the container did not ask for (node made inside, minor {minor})"
mknod /dev/not-mine c 195 {minor}
cat /dev/not-mine 2>&1 | sed 's/^/    /'
"""


def _not_requested(gpus, visible: str):
    """Minor of a simulated GPU that NVIDIA_VISIBLE_DEVICES=`visible` does not name, or None."""
    wanted = {part.strip().lower() for part in visible.split(",")}
    if "all" in wanted:
        return None
    for gpu in gpus:
        if str(gpu["index"]) not in wanted and gpu["uuid"].lower() not in wanted:
            return gpu["minor"]
    return None


# What the demo shows of each decision-log line (docs/logging.md has them all).
LOG_KEYS = ("stage", "container", "decision", "gpus", "capabilities", "cgroup", "rules_added", "grants",
            "seconds")


@click.command(help=(
    "Start a real runc container (busybox) on a simulated 4-GPU host with "
    "NVIDIA_VISIBLE_DEVICES=0,1 and gpuhook as its prestart and poststop hooks, and show what the "
    "container sees (its GPU nodes, nvidia-smi, a GPU it did not ask for: EPERM, the driver "
    "libraries) and what gpuhook logged for its start and its stop. "
    "Needs root, runc, busybox-static and a C compiler."
))
@click.option("--workdir", metavar="DIR",
              help="Where the simulated host, bundle and runc state go (a DIR an earlier demo made is replaced) "
                   "[default: a new directory /tmp/gpuhook-demo-XXXXXXXX, so demos never share one].")
@click.option("--visible", default="0,1", show_default=True, help="NVIDIA_VISIBLE_DEVICES for the container.")
def demo(workdir, visible):
    if os.geteuid() != 0:
        raise click.ClickException("gpuhook demo needs root: it builds device nodes and starts a runc container")
    if workdir is None:
        workdir = tempfile.mkdtemp(prefix="gpuhook-demo-", dir="/tmp")
    else:
        workdir = os.path.abspath(workdir)
        if os.path.isdir(workdir):
            if not os.path.exists(f"{workdir}/.gpuhook-demo"):
                raise click.UsageError(f"{workdir} exists and was not made by gpuhook demo; pick another --workdir")
            shutil.rmtree(workdir)
        os.makedirs(workdir)
    open(f"{workdir}/.gpuhook-demo", "w").close()
    # The container's id (and with it its cgroup and runc state) is this demo's own.
    name = os.path.basename(workdir)
    container_id = name if name.startswith("gpuhook-") else "gpuhook-" + name
    click.echo(f"1. simulated host with 4 GPUs in {workdir}/host")
    sim = host.build(f"{workdir}/host", gpus=4)
    libdir = "/usr/lib64"
    other = _not_requested(sim["gpus"], visible)
    not_mine = NOT_MINE.format(minor=other) if other is not None else ""
    state_root = f"{workdir}/runc-state"
    os.makedirs(state_root)
    runc_path = shutil.which("runc") or "runc"
    bundle = runc.write_bundle(
        f"{workdir}/bundles/demo", runc.runc_spec(runc_path, f"{workdir}/.spec-template"),
        args=["/bin/busybox", "sh", "-c", SCRIPT.format(not_mine=not_mine, libdir=libdir)],
        env=[f"NVIDIA_VISIBLE_DEVICES={visible}",
             f"NVIDIA_DRIVER_CAPABILITIES={','.join(sorted(DEFAULT_CAPABILITIES))}"],
        hooks={"prestart": [runc.hook_entry(sim["config"])],
               "poststop": [runc.hook_entry(sim["config"], "poststop")]},
        # The container's cgroup is this demo's own (runc's default /<id> two demos would share).
        cgroups_path=f"/{container_id}",
        edit=lambda spec: spec["process"]["env"].append("PATH=/bin:/usr/bin"),
    )
    for name in ("grep", "head", "wc", "sed", "mknod", "cut"):
        link = f"{bundle}/rootfs/bin/{name}"
        if not os.path.lexists(link):
            os.symlink("busybox", link)
    click.echo(f"2. bundle {bundle} with NVIDIA_VISIBLE_DEVICES={visible}, gpuhook registered as prestart and poststop hook")
    click.echo("3. runc run (output of the container follows; runc deletes the container when it exits)\n")
    returncode, stdout, stderr = runc.run(runc_path, state_root, bundle, container_id)
    click.echo(stdout.rstrip())
    if returncode != 0:
        click.echo(stderr.rstrip(), err=True)
        raise click.ClickException(f"runc exited with {returncode}")
    click.echo("\n4. gpuhook's decision log (" + sim["directory"] + "/gpuhook.log), the start's line and the stop's:")
    try:
        with open(f"{sim['directory']}/gpuhook.log") as f:
            lines = [json.loads(line) for line in f.read().splitlines()[-2:]]
    except (OSError, ValueError):
        lines = []
    for line in lines:
        click.echo(json.dumps({k: line[k] for k in LOG_KEYS if k in line}, indent=2))
    if not lines:
        click.echo("(no log line found)")
    click.echo(f"\n(everything is in {workdir}; remove it with: rm -rf {workdir})")
