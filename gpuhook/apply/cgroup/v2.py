"""cgroup v2 device access: rebuild the container's device programs with our rules in front.

runc (and systemd, for units with a device policy) attach BPF_PROG_TYPE_CGROUP_DEVICE
programs to the container's cgroup before prestart hooks run, and every attached program
must allow an access (docs/runtime-facts.md §5). So `grant` takes each attached program
that does not yet allow what the container needs, reads its translated instructions, loads
[our allow blocks + those instructions] (gpuhook.devrules.program) and swaps it in place of
the old one with BPF_F_REPLACE. It keeps the old programs open, so `revoke` can put them
back exactly when a later step of the start fails. Nothing is changed until every new
program has loaded; a program that cannot be rebuilt (hardened, helper calls) or that the
verifier refuses fails the grant with one line, and the original programs stay attached.

`describe` reads a cgroup's effective device rules for `gpuhook cgroup show`, v1 or v2.
"""

import errno
import os

from gpuhook.devrules import program
from gpuhook.devrules.devices import without_letters
from gpuhook.errors import ApplyError, HostError, printable
from gpuhook.record import record

CAPABILITY_HINT = "device programs need CAP_SYS_ADMIN, CAP_BPF and CAP_NET_ADMIN: run gpuhook as root from the runtime"
HARDENED_HINT = ("set the sysctl net.core.bpf_jit_harden to 1 (hardens unprivileged programs only) or 0, "
                 "then start the container again")


class Swap(record("Swap", "old_id old_fd new_id new_fd how")):
    """One program replaced: the original (kept open to put it back) and ours."""

    __slots__ = ()


class ProgramGrant:
    """What a v2 grant changed.

    Iterates over the rules it added, like the list gpuhook.apply.cgroup.v1.grant returns (the
    hook logs them); holds the cgroup and the original programs open so that `revoke` can
    put them back. `close` releases them; the hook simply exits.
    """

    def __init__(self, cgroup_fd: int = -1):
        self.rules: list = []
        self.swaps: list = []
        self.cgroup_fd = cgroup_fd

    def added(self, swap: Swap, rules) -> None:
        self.swaps.append(swap)
        self.rules += [rule for rule in rules if rule not in self.rules]

    def __iter__(self):
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def __getitem__(self, index):
        return self.rules[index]

    def __repr__(self) -> str:
        return f"ProgramGrant(rules={self.rules!r}, swaps={self.swaps!r})"

    def close(self) -> None:
        for swap in self.swaps:
            for fd in (swap.old_fd, swap.new_fd):
                _close(fd)
        self.swaps = []
        _close(self.cgroup_fd)
        self.cgroup_fd = -1


def _close(fd: int) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


def _failure(what: str, directory: str, err: OSError) -> ApplyError:
    hint = CAPABILITY_HINT if err.errno in (errno.EPERM, errno.EACCES) else None
    return ApplyError("cgroup", f"cannot {what} of {directory}: {err.strerror or err}", hint)


def _open_cgroup(directory: str) -> int:
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise ApplyError("cgroup", f"cannot open the cgroup {directory}: {err.strerror}") from err


def _unique(rules) -> list:
    out = []
    for rule in rules:
        if not rule.allow:
            raise ValueError(f"a grant adds allow rules, not {rule}")
        if rule not in out:
            out.append(rule)
    return out


def grant(directory: str, rules, *, build=program.prepend, use_replace: bool = True) -> ProgramGrant:
    """Allow `rules` in every device program attached to the cgroup at `directory`.

    Returns a ProgramGrant (the rules added, empty when nothing was needed, e.g. a privileged
    container with no device program). `build(rules, original_insns)` makes the new
    instructions and `use_replace` False forces the attach-then-detach swap of kernels
    before 5.6; both exist for tests. Raises ApplyError with the original programs attached.
    """
    from gpuhook.apply.cgroup import bpf

    wanted = _unique(rules)
    done = ProgramGrant()
    if not wanted:
        return done
    done.cgroup_fd = _open_cgroup(directory)
    try:
        try:
            ids = bpf.query(done.cgroup_fd)
        except OSError as err:
            raise _failure("list the device programs", directory, err) from err
        policy, others = _runtime_programs(bpf, ids)
        for prog_id in policy:
            _grant_one(bpf, done, directory, prog_id, wanted, build, use_replace)
        for prog_id in others:
            _refuse_denial(bpf, prog_id, wanted, f"device program {prog_id}{{name}} on {directory} was not "
                           "attached by the runtime and",
                           "gpuhook widens only the runtime's device policy: detach that program or "
                           "allow the NVIDIA devices in it")
        if ids:
            _refuse_denial_above(bpf, done.cgroup_fd, directory, wanted)
    except BaseException as failure:
        problems = revoke(directory, done)
        if problems and isinstance(failure, ApplyError):
            failure.hint = "; ".join(filter(None, [failure.hint] + problems))
        raise
    if not done.swaps:
        done.close()
    return done


# systemd's name for the program it attaches for a unit's DeviceAllow=/DevicePolicy=, which
# the runtime sets from the container's spec (docs/cgroup-v2.md, "whose program is it").
SYSTEMD_PROGRAM_NAME = "sd_devices"


def _runtime_programs(bpf, ids: list) -> tuple:
    """Split the cgroup's own programs (query order = attach order) into the runtime's device
    policy, which gpuhook widens, and other parties' programs, which it never changes.

    runc and crun attach their program, then detach every other device program of the
    cgroup, before any hook runs: at prestart the first program is the runtime's. systemd's
    program for the unit (re-attached on daemon-reload) carries the runtime's DeviceAllow=
    and gpuhook's own rebuilt programs carry it too; everything else was attached by someone
    else and is only checked (`_refuse_denial`)."""
    policy, others = [], []
    for position, prog_id in enumerate(ids):
        if position == 0:
            policy.append(prog_id)
            continue
        name = _program_name(bpf, prog_id)
        (policy if name in (SYSTEMD_PROGRAM_NAME, program.PROGRAM_NAME) else others).append(prog_id)
    return policy, others


def _program_name(bpf, prog_id: int) -> str | None:
    try:
        fd = bpf.open_program(prog_id)
    except OSError:
        return None
    try:
        return bpf.program_info(fd).name
    except OSError:
        return None
    finally:
        _close(fd)


def _refuse_denial(bpf, prog_id: int, wanted: list, what: str, hint: str) -> None:
    """Raise ApplyError when program `prog_id` denies one of `wanted`. `what` names it (its
    "{name}" field gets the program's name). A program gpuhook cannot read or decode is
    given the benefit of the doubt; one that is gone no longer applies."""
    try:
        fd = bpf.open_program(prog_id)
    except OSError:
        return
    try:
        info = bpf.program_info(fd)
        rules = program.program_rules(program.decode_bytes(info.code))[1]
    except (OSError, program.ProgramError, program.DecodeError):
        return
    finally:
        _close(fd)
    if rules is None:
        return
    for rule in wanted:
        if not program.allows(rules, rule):
            named = what.replace("{name}", f" ({printable(info.name)})" if info.name else "", 1)
            raise ApplyError("cgroup", f"{named} denies {rule.v1_line().strip()}: "
                                       "the container could not open it", hint)


def _refuse_denial_above(bpf, cgroup_fd: int, directory: str, wanted: list) -> None:
    """Every device program that runs for the cgroup must allow an access, those attached to
    its parents included (BPF_F_QUERY_EFFECTIVE lists them). gpuhook changes only the
    cgroup's own programs; a parent's program that denies a device we grant would make the
    start report the GPU injected while opening it gives EPERM, so the start fails instead."""
    try:
        own = set(bpf.query(cgroup_fd))
        effective = bpf.query(cgroup_fd, effective=True)
    except OSError:
        return  # kernels without effective queries: nothing more can be known
    for prog_id in effective:
        if prog_id not in own:
            _refuse_denial(bpf, prog_id, wanted, f"device program {prog_id}{{name}} on a parent cgroup of {directory}",
                           "allow the NVIDIA devices in the parent cgroup's device policy")


def _grant_one(bpf, done: ProgramGrant, directory: str, prog_id: int, wanted: list, build, use_replace: bool) -> None:
    try:
        old_fd = bpf.open_program(prog_id)
    except OSError as err:
        if err.errno == errno.ENOENT:
            return  # detached since the query: it no longer applies
        raise _failure(f"open device program {prog_id}", directory, err) from err
    new_fd = -1
    try:
        try:
            info = bpf.program_info(old_fd)
        except OSError as err:
            raise _failure(f"read device program {prog_id}", directory, err) from err
        where = f"device program {prog_id} of {directory}"
        try:
            insns = program.decode_bytes(info.code)
            program.check_rebuildable(insns)
            if info.map_count:
                raise program.ProgramError("it uses maps; gpuhook only rebuilds plain device programs")
            original = program.split(insns)[1]
            ours, whole = program.program_rules(insns)
        except program.BlindedProgram as err:
            raise ApplyError("cgroup", f"{where} is hardened: {err}", HARDENED_HINT) from None
        except program.ProgramError as err:
            raise ApplyError("cgroup", f"cannot rebuild {where}: {err}") from None
        # Rules the program already allows need nothing; an undecodable original is
        # treated as allowing nothing beyond our own prefix (prepending more is harmless).
        known = whole if whole is not None else ours
        needed = [rule for rule in wanted if not program.allows(known, rule)]
        if not needed:
            return
        code = program.encode(build(ours + needed, original))
        try:
            new_fd = bpf.load(code, program.PROGRAM_NAME)
            new_id = bpf.program_info(new_fd).id
        except bpf.VerifierError as err:
            raise ApplyError("cgroup", f"the kernel's verifier refused the rebuilt {where}: {err.reason}") from None
        except OSError as err:
            raise _failure("load a rebuilt device program", directory, err) from err
        try:
            how = bpf.swap(done.cgroup_fd, old_fd, new_fd, use_replace)
        except OSError as err:
            raise _failure(f"swap in the rebuilt device program {prog_id}", directory, err) from err
        # Recorded at once: from here on, revoke must be able to put the original back.
        done.added(Swap(prog_id, old_fd, new_id, new_fd, how), needed)
        old_fd = new_fd = -1
    finally:
        _close(old_fd)
        _close(new_fd)


def revoke(directory: str, added) -> list:
    """Put back the programs a ProgramGrant replaced, newest first; returns problems, never raises."""
    if not isinstance(added, ProgramGrant):
        return [f"{directory}: nothing recorded to restore"] if added else []
    from gpuhook.apply.cgroup import bpf

    problems = []
    for swap in reversed(added.swaps):
        try:
            bpf.swap(added.cgroup_fd, swap.new_fd, swap.old_fd, swap.how == "replace")
        except OSError as err:
            problems.append(f"cannot put back device program {swap.old_id} in {directory}: {err.strerror or err}")
    added.close()
    added.rules = []
    return problems


def take_back(directory: str, rules) -> list:
    """Take `rules` (letters of devices a stopped container was granted) out of every device
    program of the cgroup at `directory` that gpuhook rebuilt: each is rebuilt again with its
    prefix less those letters, in front of the same original program, and swapped in place
    (gpuhook.apply.grants, for a cgroup that outlives its container). Returns problems, never
    raises; a program that is no longer there needs nothing."""
    from gpuhook.apply.cgroup import bpf

    problems = []
    try:
        cgroup_fd = _open_cgroup(directory)
    except ApplyError as err:
        return [err.one_line()]
    try:
        try:
            ids = bpf.query(cgroup_fd)
        except OSError as err:
            return [f"cannot list the device programs of {directory}: {err.strerror or err}"]
        for prog_id in ids:
            if _program_name(bpf, prog_id) != program.PROGRAM_NAME:
                continue
            problem = _take_back_one(bpf, cgroup_fd, directory, prog_id, rules)
            if problem:
                problems.append(problem)
    finally:
        _close(cgroup_fd)
    return problems


def _take_back_one(bpf, cgroup_fd: int, directory: str, prog_id: int, rules) -> str:
    old_fd = new_fd = -1
    try:
        old_fd = bpf.open_program(prog_id)
        insns = program.decode_bytes(bpf.program_info(old_fd).code)
        program.check_rebuildable(insns)
        prefix, original = program.split(insns)
        ours = program.decode(prefix, stop=len(prefix)).rules if prefix else []
        kept = without_letters(ours, rules)
        if kept == list(ours):
            return ""
        new_fd = bpf.load(program.encode(program.prepend(kept, original)), program.PROGRAM_NAME)
        bpf.swap(cgroup_fd, old_fd, new_fd, True)
        return ""
    except (program.ProgramError, bpf.VerifierError) as err:
        return f"cannot rebuild device program {prog_id} of {directory}: {err}"
    except OSError as err:
        if err.errno == errno.ENOENT:
            return ""  # detached meanwhile: nothing of it applies any more
        return f"cannot take back from device program {prog_id} of {directory}: {err.strerror or err}"
    finally:
        _close(old_fd)
        _close(new_fd)


# --- reading, for `gpuhook cgroup show` ---------------------------------------------------

class AttachedProgram(record("AttachedProgram", "id name tag inherited instructions ours rules error disassembly")):
    """A device program that runs for a cgroup. `rules` is its decision list (None with
    `error` when it cannot be decoded); `ours` are the rules in gpuhook's prefix."""

    __slots__ = ()

    def as_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "tag": self.tag, "inherited": self.inherited,
                "instructions": self.instructions, "gpuhook_rules": [r.as_dict() for r in self.ours],
                "rules": None if self.rules is None else [r.as_dict() for r in self.rules],
                "error": self.error}


def attached_programs(directory: str) -> list:
    """The device programs that run for the cgroup at `directory`: its own first, then
    those inherited from its ancestors."""
    from gpuhook.apply.cgroup import bpf

    fd = _open_cgroup(directory)
    try:
        try:
            here = bpf.query(fd)
            everything = bpf.query(fd, effective=True)
        except OSError as err:
            raise _failure("list the device programs", directory, err) from err
        found = []
        for prog_id in here + [i for i in everything if i not in here]:
            try:
                prog_fd = bpf.open_program(prog_id)
            except OSError as err:
                if err.errno == errno.ENOENT:
                    continue
                raise _failure(f"open device program {prog_id}", directory, err) from err
            try:
                info = bpf.program_info(prog_fd)
            except OSError as err:
                raise _failure(f"read device program {prog_id}", directory, err) from err
            finally:
                os.close(prog_fd)
            found.append(_describe_program(info, inherited=prog_id not in here))
        return found
    finally:
        os.close(fd)


def _describe_program(info, inherited: bool) -> AttachedProgram:
    insns = program.decode_bytes(info.code)
    ours, rules, error = [], None, None
    try:
        program.check_rebuildable(insns)
        prefix, original = program.split(insns)
        ours = program.decode(prefix, stop=len(prefix)).rules if prefix else []
        rest = program.decode(original)
        if rest.complete:
            rules = ours + rest.rules
        else:
            error = "the program runs off its end without a verdict"
    except program.ProgramError as err:
        error = str(err)
    return AttachedProgram(info.id, info.name, info.tag, inherited, len(insns), ours, rules, error,
                           program.disassemble(insns))


class CgroupReport(record("CgroupReport", "mode directory cgroup_path rules programs systemd")):
    """What `gpuhook cgroup show` prints: v1 `rules` from devices.list, or v2 `programs`;
    `systemd` is a gpuhook.apply.cgroup.systemd.UnitStatus."""

    __slots__ = ()

    def allowed(self) -> list:
        """Every allow rule in effect somewhere (v1 list, or any v2 program)."""
        if self.mode == "v1":
            return [r for r in self.rules if r.allow]
        found = []
        for prog in self.programs:
            for rule in prog.rules or prog.ours:
                if rule.allow and rule not in found:
                    found.append(rule)
        return found

    def as_dict(self) -> dict:
        return {"mode": self.mode, "directory": self.directory, "cgroup": self.cgroup_path,
                "rules": None if self.rules is None else [r.as_dict() for r in self.rules],
                "programs": None if self.programs is None else [p.as_dict() for p in self.programs],
                "systemd": self.systemd.as_dict()}


def placement_of_directory(directory: str, mountinfo: str | bytes | None = None):
    """A hierarchy.Placement for a cgroup directory given by path: v1 if it has
    devices.list, v2 if it has cgroup.controllers; its cgroup path from the mount table."""
    from gpuhook.apply.cgroup import hierarchy
    from gpuhook.kernel import mountinfo as mount_table

    # abspath, not realpath: /proc/PID/root/... must keep naming the other mount namespace.
    directory = os.path.abspath(directory)
    if os.path.exists(f"{directory}/devices.list"):
        mode = hierarchy.V1
    elif os.path.exists(f"{directory}/cgroup.controllers"):
        mode = hierarchy.V2
    else:
        raise HostError(f"{directory} is not a cgroup directory (no devices.list, no cgroup.controllers)")
    table = mount_table.read_bytes() if mountinfo is None else \
        os.fsencode(mountinfo) if isinstance(mountinfo, str) else mountinfo
    cgroup_path = "/" + os.path.basename(directory)
    best = ""
    for _, root, point, _ in mount_table.cgroup_mounts_in(table):
        point = point.rstrip("/") or "/"
        inside = directory == point or directory.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best = point
            rest = directory[len(point.rstrip("/")):]
            cgroup_path = (root.rstrip("/") + rest) or "/"
    return hierarchy.Placement(mode, directory, cgroup_path)


def describe(place, systemd=None) -> CgroupReport:
    """The effective device rules of the cgroup at `place` (a hierarchy.Placement), and
    whether systemd knows the allowed ones. `systemd` is a gpuhook.apply.cgroup.systemd.Systemd."""
    from gpuhook.apply.cgroup import hierarchy
    from gpuhook.apply.cgroup import systemd as sd

    systemd = systemd or sd.Systemd()
    if place.mode == hierarchy.V1:
        from gpuhook.apply.cgroup import v1

        try:
            rules = v1.current_rules(place.directory)
        except ApplyError as err:
            raise HostError(err.message.partition(": ")[2]) from err
        report = CgroupReport(place.mode, place.directory, place.cgroup_path, rules, None, None)
    else:
        try:
            programs = attached_programs(place.directory)
        except ApplyError as err:
            raise HostError(err.message.partition(": ")[2], err.hint) from err
        report = CgroupReport(place.mode, place.directory, place.cgroup_path, None, programs, None)
    return report._replace(systemd=systemd.status(place.cgroup_path, report.allowed()))
