"""The only layer that changes anything: turn a Plan into system calls (host side).

Two halves, at the same time, and why:

- cgroup: allow the devices (host side, this process). runc has applied its own rules
  before prestart hooks run, so we add ours on top and remember what we added.
- In the namespace worker, a child that joins the container's mount namespace (the
  container's /dev tmpfs and its /proc exist only there, docs/runtime-facts.md §1): device
  nodes, bind mounts (read-only, nosuid, nodev), soname symlinks, the /proc/driver/nvidia
  mask, and the HOST's ldconfig against the rootfs. Every container path is resolved inside
  the rootfs (gpuhook.kernel.paths) and mounted through /proc/self/fd, so what was checked is
  what gets mounted.

Neither half needs the other (the worker's mknod is checked against the hook's own cgroup,
not the container's), so the worker gets its order first and the grant runs while it works
(gpuhook.apply.worker), and so does the health step (gpuhook.health.hooks: check and repair
the GPUs; none of it touches the container). The worker keeps its work only when the hook
commits, after the grant and the health step succeeded; the container runs no code before
the hook returns, so it never gets a GPU that failed its check. Any failure undoes both
halves, newest first: mounts, then created files, symlinks and directories, then our cgroup
rules, and the error names the step. The worker names each step as it starts, so a deadline
names the step that was cut off.

This module is the host side: the cgroup grant, the health step, the records poststop needs,
and the worker's supervision. What runs inside the container's mount namespace is
gpuhook.apply.nsworker.
"""

import os

from gpuhook.apply import served, statefiles
from gpuhook.apply import worker as workers
from gpuhook.apply.order import encode_order
from gpuhook.apply.cgroup import hierarchy
from gpuhook.kernel import caller
from gpuhook.kernel import mountinfo as mount_table
from gpuhook.errors import GpuhookError, HostError, InputError
from gpuhook.plan.records import ProcMask

# The worker's and the health step's deadlines are this much shorter than the hook's, so
# that undoing a start (the worker's steps, the grant) still fits in the hook's own time.
CLEANUP_MARGIN = 1.0


class Applied:
    def __init__(self, cgroup_mode: str, rules_added: list, notes: list, steps: int, ldconfig_output: str = "",
                 cgroup_directory: str = ""):
        self.cgroup_mode = cgroup_mode
        self.cgroup_directory = cgroup_directory
        self.rules_added = rules_added
        self.notes = notes
        self.steps = steps
        self.ldconfig_output = ldconfig_output  # for gpuhook's log only


def _open_namespace(pid: int, kind: str, what: str):
    """(fd of process `pid`'s namespace `kind`, whether the hook shares it)."""
    try:
        fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise HostError(f"container process {pid} is gone") from None
    except OSError as err:
        raise HostError(f"cannot open the {what} namespace of process {pid}: {err.strerror}") from err
    return fd, os.fstat(fd).st_ino == os.stat(f"/proc/self/ns/{kind}").st_ino


def open_container_mntns(pid: int) -> int:
    """fd of the container's mount namespace; refuses the hook's own namespace."""
    fd, shared = _open_namespace(pid, "mnt", "mount")
    if shared:
        os.close(fd)
        raise HostError(f"process {pid} shares the hook's mount namespace: it is not a container being created")
    return fd


def open_container_userns(pid: int):
    """fd of the container's user namespace, or None when it shares the hook's."""
    fd, shared = _open_namespace(pid, "user", "user")
    if shared:
        os.close(fd)
        return None
    return fd


def read_proc_files(mask: ProcMask) -> dict:
    """Contents for the masked /proc/driver/nvidia, read on the host side."""
    files = {}
    for name in ("params", "version", "registry"):
        try:
            with open(f"{mask.source_dir}/{name}", "rb") as f:
                data = f.read(1 << 20)
        except FileNotFoundError:
            continue
        except OSError as err:
            raise HostError(f"cannot read {mask.source_dir}/{name}: {err.strerror}") from err
        if name == "params":
            data = _no_device_files(data)
        files[name] = data.decode("utf-8", "surrogateescape")
    for name in mask.capabilities:
        path = f"{mask.source_dir}/capabilities/{name}"
        try:
            with open(path, "rb") as f:
                files[f"capabilities/{name}"] = f.read(1 << 16).decode("utf-8", "surrogateescape")
        except OSError as err:
            raise HostError(f"cannot read {path}: {err.strerror}") from err
    return files


def _no_device_files(params: bytes) -> bytes:
    lines = [b"ModifyDeviceFiles: 0" if line.startswith(b"ModifyDeviceFiles:") else line
             for line in params.splitlines()]
    if not any(line.startswith(b"ModifyDeviceFiles:") for line in lines):
        lines.append(b"ModifyDeviceFiles: 0")
    return b"\n".join(lines) + b"\n"


def run(plan, state, config, deadline: float, names: dict, log: dict, stage: str = "prestart") -> Applied:
    """Carry out the whole plan: the container's devices and files and the cgroup grant
    (`begin`), the health step (check and repair the GPUs: the health daemon asked before
    the grant, its answer read after it) while the worker works, then, once both are fine,
    commit (`Pending.finish`). What poststop needs is recorded on the way: while the worker
    works, each taken back if the start fails, the record that `stage` served this start
    (gpuhook.apply.served; written after the commit it was 0.3 ms of a start) and the health
    registry entry, with the container's Kubernetes `names` (journal.k8s_names); after the
    commit, the cgroup grant record (gpuhook.apply.grants). A failed health step undoes the
    rest: the container never gets a GPU that failed its check. A worker that had to be
    killed before it undid its work leaves what its journal says: gpuhook.apply.leftovers
    takes it back (or records it). `log` (the hook's log line) receives the decisions;
    nothing is read from it."""
    if plan.empty:
        return Applied("", [], [], 0)
    health = entry = check = None
    pending = Pending()
    record = None  # the served record written for this start: removed if it fails
    try:
        if plan.health is not None:
            # Only now, and only for GPUs: with health off nothing of NVML, threads or
            # gpuhook.health is imported.
            from gpuhook.health import hooks as health

        def ask_health():
            # The health daemon prepares the GPUs while this process grants the cgroup rules
            # and writes the served record (about 1.5 ms of a start as installed). Cut off
            # early enough that undoing the rest still fits in the hook's time.
            nonlocal check
            check = health.begin_start(plan, state, config, deadline - CLEANUP_MARGIN, log)

        begin(plan, deadline, pending, ask_health if health is not None else None)
        record = served.save(config.state_dir, state.id, state.pid, stage)
        if health is not None:
            try:
                check.finish()
                # Registered while the worker still works; taken back if the start fails.
                # Only after the check: a process the check finds on the GPUs must not count
                # as this container's.
                entry = health.register_container(plan, state, config, names, log)
            except BaseException as err:
                pending.abort(deadline, err)
                raise
        try:
            outcome = pending.finish(deadline)
        except BaseException:
            if health is not None:
                health.unregister(config, entry, log)
            raise
        # The grant record only once the start is committed. Every grant is recorded, also one
        # that added nothing (what it planned keeps those letters for it when a container
        # sharing its cgroup stops); a container that got no grant (no cgroup of its own) is
        # not. Written before the commit, it made a sibling's poststop keep the GPU for this
        # start, which then failed, took its record back, and left the GPU allowed in the
        # shared cgroup with nobody to take it back (attacker pass 24).
        if plan.rules and outcome.cgroup_directory:
            _record_grant(plan, state, config, outcome, log)
    except BaseException as err:
        if check is not None:
            check.close()
        if record is not None:
            try:
                statefiles.remove(record)
            except OSError:
                pass
        _settle_worker(pending.close(), plan, config, log, err)
        raise
    worker = pending.close()
    if worker is not None:
        worker.release()
    return outcome


def _settle_worker(worker, plan, config, log: dict, err: BaseException) -> None:
    """After a failed start: what the worker reported leaving stuck goes to the log, and a
    worker killed before it undid its work has its leftovers taken back or recorded
    (gpuhook.apply.leftovers); the error's hint says so in a few words."""
    if worker is None:
        return
    worker.settling = True  # the hook's backstop leaves it to this thread
    try:
        if worker.left:
            log["left_behind_processes"] = worker.left
        if worker.unsettled:
            from gpuhook.apply import leftovers

            note = leftovers.settle(worker, plan.rootfs, plan.container_id, config.state_dir, log)
            if note and isinstance(err, GpuhookError):
                err.hint = "; ".join(filter(None, [err.hint, note]))
    finally:
        worker.release()
        worker.settling = False


def _record_grant(plan, state, config, outcome, log: dict) -> None:
    """Remember a cgroup grant (v1 rules, or what a v2 device program gained), so poststop
    can take it back from a cgroup that outlives the container (gpuhook.apply.grants). Best
    effort, like the health registry: the log says when it failed."""
    from gpuhook.apply import grants

    try:
        grants.save(config.state_dir, state.id, plan.pid, outcome.cgroup_directory, plan.rules,
                    list(outcome.rules_added), mode=outcome.cgroup_mode)
    except (OSError, LookupError) as err:
        log["grant_record"] = f"not recorded: {err}"


def begin(plan, deadline: float, pending: "Pending", meanwhile=None) -> "Pending":
    """Set both halves of a start going in `pending`: the namespace worker
    (gpuhook.apply.worker, usually forked before the planning began) gets its order and works
    in the container while this process grants the cgroup rules; `meanwhile()`, when given,
    runs between the two (it sets the health step going). Raises after undoing when the
    grant fails."""
    if plan.pid <= 0:
        raise InputError("state: no container pid; gpuhook runs as a prestart or createRuntime hook")
    # The namespaces stay open until the worker has reported: it opens them again by pid and
    # compares their identity, which only a namespace held alive here makes unambiguous (a
    # freed namespace's inode number can be given to a new one).
    pending.ns_fd = ns_fd = open_container_mntns(plan.pid)
    try:
        if plan.userns:
            pending.user_fd = open_container_userns(plan.pid)
        proc_files = read_proc_files(plan.proc_mask) if plan.proc_mask else {}
        pending.worker = workers.take()
        pending.worker.context = (plan.rootfs, plan.container_id)
        pending.worker.send_order(encode_order(
            plan, _identity(ns_fd), None if pending.user_fd is None else _identity(pending.user_fd), proc_files,
            deadline - CLEANUP_MARGIN))
        if meanwhile is not None:
            meanwhile()
        # The cgroup's place only once the worker has its order: the grant needs it, the
        # worker does not (0.3-0.5 ms off a start's critical path). One read of the mount
        # table for the container's place and the runtime's.
        try:
            table = mount_table.read_bytes()
        except OSError:
            table = None  # placement reads it itself, and says why it cannot
        pending.place = hierarchy.placement(plan.pid, mountinfo=table)
        pending.granted = not (plan.rules and _shares_the_runtimes_cgroup(pending.place, table))
        if not pending.granted:
            # crun --cgroup-manager=disabled, podman --cgroups=disabled: the container lives in
            # the cgroup of whoever started the runtime (a host service, another container).
            # A grant there would open the GPUs to every process in it, so there is none: the
            # container has the device access of that cgroup, as without the hook.
            pending.notes.append("no cgroup grant: the container has no cgroup of its own (it runs in the "
                                 "cgroup of the process that started the runtime, whose device rules are not "
                                 "the container's to widen)")
        else:
            pending.added = _grant(pending.place, plan.rules)
        if pending.granted:
            from gpuhook.apply import grants  # noqa: F401 - loaded while the worker works (run records the grant)
    except BaseException as err:
        if pending.worker is not None:
            _add_undo_problems(err, pending.worker.abort(deadline))
        raise
    return pending


class Pending:
    """A start whose two halves are under way: the worker's, ordered, and the cgroup grant,
    made. `finish` commits both, `abort` undoes both; `close` in any case."""

    def __init__(self):
        self.ns_fd = None
        self.user_fd = None
        self.place = None
        self.added: list = []
        self.worker = None
        self.notes: list = []
        self.granted = True

    def finish(self, deadline: float) -> Applied:
        """Wait for the worker's report and commit; raises after undoing both halves."""
        try:
            report = self.worker.report(deadline)
        except BaseException as err:
            _undo_grant(self.place, self.added, err)
            raise
        self.worker.commit()
        return Applied(self.place.mode, self.added, self.notes + report.get("notes", []), report.get("steps", 0),
                       report.get("ldconfig_output", ""), self.place.directory if self.granted else "")

    def abort(self, deadline: float, err: BaseException) -> None:
        """Undo both halves while `err` unwinds; what could not be undone joins its hint."""
        _add_undo_problems(err, self.worker.abort(deadline) + _revoke(self.place, self.added))

    def close(self):
        """End the worker (a committed one is reaped by workers.discard, once the hook's
        log line is written) and close the namespaces. Returns an uncommitted worker, ended
        (or given up on: `stuck`), whose shared memory the caller releases; else None."""
        worker, self.worker = self.worker, None
        if worker is not None and worker.committed:
            workers.reap_later(worker)
            worker = None
        elif worker is not None:
            worker.close()
        for fd in (self.ns_fd, self.user_fd):
            if fd is not None:
                os.close(fd)
        self.ns_fd = self.user_fd = None
        return worker


def _add_undo_problems(err: BaseException, problems: list) -> None:
    if problems and isinstance(err, GpuhookError):
        err.hint = "; ".join(filter(None, [err.hint, "undo: " + "; ".join(problems)]))


def _identity(fd: int) -> tuple:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def _shares_the_runtimes_cgroup(place, table: bytes | None) -> bool:
    """Whether the container's cgroup (its init's) is the one this hook runs in, which is the
    runtime's: the runtime made none for the container. Compared by the directories' identity;
    `table`: the mount table `place` was found in (None: read it)."""
    try:
        own = hierarchy.placement(caller.pid(), mountinfo=table)
        if own.mode != place.mode:
            return False
        mine, theirs = os.stat(own.directory), os.stat(place.directory)
    except (OSError, GpuhookError):
        return False
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def _grant(place, rules) -> list:
    if place.mode == hierarchy.V1:
        from gpuhook.apply.cgroup import v1

        added = v1.grant(place.directory, rules)
    else:
        from gpuhook.apply.cgroup import v2

        added = v2.grant(place.directory, rules)
    # systemd re-applies a scope's device list on daemon-reload and would drop what it does
    # not know (docs/runtime-facts.md §5); a refusal undoes the grant, so the start fails with nothing half-done.
    # Only a scope can be systemd's (cgroupfs-driver containers never are): skip the import.
    if not place.cgroup_path.rstrip("/").endswith(".scope"):
        return added
    from gpuhook.apply.cgroup import systemd

    try:
        systemd.Systemd().register(place.cgroup_path, rules)
    except BaseException as err:
        _undo_grant(place, added, err)
        raise
    return added


def _undo_grant(place, added, err: BaseException) -> None:
    """Take back a grant while `err` unwinds; a failed undo is added to err's hint."""
    _add_undo_problems(err, _revoke(place, added))


def _revoke(place, added) -> list:
    """Take back a grant; returns the problems (it never raises: it runs while unwinding)."""
    if not added:
        return []
    if place.mode == hierarchy.V1:
        from gpuhook.apply.cgroup import v1

        return v1.revoke(place.directory, added)
    from gpuhook.apply.cgroup import v2

    return v2.revoke(place.directory, added)
