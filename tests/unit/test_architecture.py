"""The tree is the pipeline (docs/architecture.md): the stages import in one direction only, and
only the modules listed here change the host. Over `ast`, so nothing is imported: a lazy import
inside a function counts like one at the top."""

import ast
import os

from conftest import REPO

PACKAGE = os.path.join(REPO, "gpuhook")
STAGES = ("request", "discover", "plan", "apply", "kernel")
# stage -> the stages it must never import (docs/architecture.md, "The rules the tree keeps")
FORBIDDEN = {
    "request": {"discover", "plan", "apply"},  # what the container asks for, from the runtime's input
    "discover": {"plan", "apply"},  # reads the host and the image; decides and changes nothing
    "plan": {"apply", "kernel"},  # pure: (request, host, config) -> Plan, no system call
    "apply": {"discover", "request"},  # carries out the plan it is given, and nothing else
}
# What the leaf may use: gpuhook's language (errors, records, JSON), nothing with a policy.
KERNEL_MAY_IMPORT = ("gpuhook.errors", "gpuhook.record", "gpuhook.fastjson")
# The health step gets the plan as data and reads NVML itself; of the stages it may use only
# the state-file writer (its reports, stamps and registry entries) and the leaf.
HEALTH_FORBIDDEN = {"request", "plan", "apply"}
HEALTH_MAY_IMPORT = ("gpuhook.apply.statefiles",)

# The system calls that change the host, by the name a module reaches them through.
MUTATORS = {f"os.{name}" for name in (
    "mknod", "rename", "replace", "unlink", "remove", "rmdir", "removedirs", "symlink", "link", "kill", "killpg",
    "chown", "lchown", "fchown", "chmod", "fchmod", "truncate", "ftruncate", "mkdir", "makedirs")} | {
    "signal.pidfd_send_signal", "shutil.rmtree", "shutil.move", "shutil.copy", "shutil.copy2", "shutil.copytree",
    "gpuhook.kernel.linux.mknodat", "gpuhook.kernel.linux.mount", "gpuhook.kernel.linux.umount2",
    "gpuhook.kernel.linux.move_mount", "gpuhook.kernel.linux.mount_setattr", "gpuhook.kernel.linux.open_tree_clone",
    "gpuhook.kernel.linux.pivot_root", "gpuhook.kernel.linux.setns", "gpuhook.kernel.linux.unshare",
    "gpuhook.apply.cgroup.bpf.attach", "gpuhook.apply.cgroup.bpf.detach", "gpuhook.apply.cgroup.bpf.swap",
    "gpuhook.kernel.child.run",  # a program run as host root: systemctl, a GPU reset, ldconfig
}
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}  # a cgroup file, a state file, the log

# module -> why it may change the host. The stages' own: apply/ and the health step's actions.
APPLY = {
    "gpuhook.apply.nsworker": "joins the container's mount and user namespaces (setns), to take its steps there",
    "gpuhook.apply.nodes": "device nodes in the container's /dev and soname links in its rootfs",
    "gpuhook.apply.mounts": "bind mounts of the driver's files into the container, and their undo",
    "gpuhook.apply.procmask": "the read-only tmpfs over the container's /proc/driver/nvidia",
    "gpuhook.apply.ldconfig": "installs the ld cache the host's ldconfig built, the image's own set aside",
    "gpuhook.apply.rootfs": "directories, files and links made in the rootfs, and their undo",
    "gpuhook.apply.ldsandbox": "the ldconfig sandbox: a private mount tree and the host's ldconfig in it",
    "gpuhook.apply.leftovers": "takes back what a killed worker left in the rootfs",
    "gpuhook.apply.worker": "kills the namespace worker it forked",
    "gpuhook.apply.cgroup.v1": "devices.allow and devices.deny of the container's cgroup",
    "gpuhook.apply.cgroup.v2": "swaps the container's device programs",
    "gpuhook.apply.cgroup.systemd": "systemctl set-property --runtime, and the /dev/char links it needs",
    "gpuhook.apply.statefiles": "every state file of gpuhook: caches, records, reports, stamps",
    "gpuhook.health.actions": "kills proven orphans (through a pidfd) and resets GPUs",
    "gpuhook.install.common": "the installer's writer: runtime configuration files, by `gpuhook install`",
}
# Outside the stages, each for a reason a reader can judge: its own files and children only.
OWN = {
    "gpuhook.kernel.child": "kills the process group of a child it started, at its timeout",
    "gpuhook.journal": "appends the decision log",
    "gpuhook.health.daemon": "its root-only socket",
    "gpuhook.agent": "its root-only socket and directory",
    "gpuhook.plugin.server": "the device plugin's socket",
    "gpuhook.plugin.build_stubs": "writes the gRPC stubs at build time",
    "gpuhook.simulate.host": "builds a simulated GPU host in a directory given to it",
    "gpuhook.simulate.nvml": "the simulated NVML's state file",
    "gpuhook.cli.democmd": "the demo's work directory",
    "gpuhook.simulate.demo": "the demo's busybox rootfs and bundle, in the demo's work directory",
}
ALLOWED = {**APPLY, **OWN}

# Findings the restructure has not removed yet, each removed with the commit that fixes it;
# the tests fail when one is fixed but still listed, so these lists only shrink.
KNOWN_IMPORTS: set = set()
KNOWN_WRITERS: set = set()


def within(name: str, modules) -> bool:
    """`name` is one of `modules`, or a name in one of them."""
    return any(name == m or name.startswith(m + ".") for m in modules)


_PARSED: list = []


def modules() -> list:
    """(dotted name, path, ast) of every module of the package, parsed once per run."""
    if not _PARSED:
        for directory, dirs, files in os.walk(PACKAGE):
            dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "_vendor", "generated"))
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                    with open(path, "rb") as f:
                        _PARSED.append((dotted, path, ast.parse(f.read(), path)))
    return _PARSED


def stage_of(module: str):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def imported(module: str, tree) -> dict:
    """Local name -> dotted name of what an import binds it to (lazy imports too)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.partition(".")[0]] = a.name if a.asname else a.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}: relative import"
            names.update({(a.asname or a.name): f"{node.module}.{a.name}" for a in node.names})
    return names


def dotted(node, names: dict):
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        base = dotted(node.value, names)
        return f"{base}.{node.attr}" if base else None
    return None


def mutations(module: str, tree) -> set:
    """The host-changing calls `module` reaches by name: any reference, called or not
    (`run = self._run or child.run` counts), resolved through the module's imports, so
    `text.replace` or `names.remove` never match."""
    names, found = imported(module, tree), set()
    for node in ast.walk(tree):
        name = dotted(node, names) if isinstance(node, (ast.Name, ast.Attribute)) else None
        if name in MUTATORS:
            found.add(name)
        if not isinstance(node, ast.Call):
            continue
        callee = dotted(node.func, names)
        flags = node.args[1] if len(node.args) > 1 else None
        if callee in ("os.open", "posix.open") and flags is not None and \
                {n.attr for n in ast.walk(flags) if isinstance(n, ast.Attribute)} & WRITE_FLAGS:
            found.add("os.open for writing")
        mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
        if isinstance(node.func, ast.Name) and node.func.id == "open" and isinstance(mode, ast.Constant) and \
                set(str(mode.value)) & set("wax+"):
            found.add("open for writing")
    return found


def import_findings() -> list:
    wrong = []
    for module, _, tree in modules():
        stage = stage_of(module)
        for target in sorted(set(imported(module, tree).values())):
            if not target.startswith("gpuhook."):
                continue
            if stage_of(target) in FORBIDDEN.get(stage, ()):
                wrong.append(f"{module} ({stage}) imports {target}")
            elif stage == "kernel" and stage_of(target) != "kernel" and not within(target, KERNEL_MAY_IMPORT):
                wrong.append(f"{module} (the leaf) imports {target}")
            elif module.startswith("gpuhook.health") and stage_of(target) in HEALTH_FORBIDDEN \
                    and not within(target, HEALTH_MAY_IMPORT):
                wrong.append(f"{module} (health) imports {target}")
    return wrong


def test_stages_import_in_one_direction_and_kernel_is_a_leaf():
    found = import_findings()
    assert sorted(set(found) - KNOWN_IMPORTS) == []
    assert sorted(KNOWN_IMPORTS - set(found)) == []  # fixed: take it off the list


def test_only_the_listed_modules_change_the_host():
    found = {module: sorted(calls) for module, _, tree in modules() if (calls := mutations(module, tree))}
    assert {m: c for m, c in found.items() if m not in ALLOWED and m not in KNOWN_WRITERS} == {}
    assert sorted(set(ALLOWED) - set(found)) == []  # the list shrinks with the code
    assert sorted(KNOWN_WRITERS - set(found)) == []


def test_the_host_is_changed_from_apply_and_the_health_step_only_among_the_stages():
    # The allow-list itself keeps the shape: within the pipeline, only apply/ and the health
    # step's actions change anything, and outside it only what owns the file or child.
    assert [m for m in APPLY if not within(m, ("gpuhook.apply", "gpuhook.health.actions", "gpuhook.install.common"))] == []
    assert [m for m in OWN if stage_of(m) not in (None, "kernel")] == []


def test_the_check_sees_the_calls_it_is_about():
    # The test's own parser, on literal sources: a rename through an alias, a kill through a
    # from-import, a reference that is not called, a cgroup write; not a str.replace.
    source = ("import os as o\nfrom os import kill\nfrom gpuhook.kernel import linux\n"
              "def f(text, fd):\n    o.rename('a', 'b')\n    kill(1, 9)\n    run = linux.mount\n"
              "    text.replace('a', 'b')\n    o.open('devices.allow', o.O_WRONLY)\n    open('x', 'rb')\n")
    assert mutations("gpuhook.x", ast.parse(source)) == {"os.rename", "os.kill", "gpuhook.kernel.linux.mount",
                                                         "os.open for writing"}
