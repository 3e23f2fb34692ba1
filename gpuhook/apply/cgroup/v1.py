"""cgroup v1 device access: devices.list, devices.allow, devices.deny.

runc applies its own rules before prestart hooks run (docs/runtime-facts.md §5), so we only
add what the container lacks, and remember exactly that, so a failed start can take back
only our additions. The kernel parses one rule per write(2). Like runc's
devices/v1.go, what was written is read back: a devices.list that does not then allow every
rule fails the grant (and undoes it) instead of reporting GPUs the container cannot open.
"""

import errno
import os

from gpuhook.devrules.devices import difference, parse_v1_line, union
from gpuhook.errors import ApplyError
from gpuhook.kernel.files import read_regular_file


def current_rules(directory: str) -> list:
    """The rules in `directory`/devices.list. `gpuhook cgroup show --path` takes any
    directory: a planted symlink or FIFO there must not make root read (or print, or wait
    on) another file, and a line that is no rule is never quoted back."""
    path = f"{directory}/devices.list"
    try:
        text = read_regular_file(path, 1 << 20, os.O_NOFOLLOW).decode("ascii", "replace")
    except OSError as err:
        if err.errno == errno.EINVAL:
            raise ApplyError("cgroup", f"{path} is not a regular file") from None
        raise ApplyError("cgroup", f"cannot read {path}: {err.strerror}") from err
    try:
        return [parse_v1_line(line) for line in text.splitlines() if line.strip()]
    except ValueError:
        raise ApplyError("cgroup", f"{path} holds a line that is not a device rule") from None


def _write(directory: str, name: str, rule) -> None:
    path = f"{directory}/{name}"
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.write(fd, rule.v1_line().encode())
    finally:
        os.close(fd)


def grant(directory: str, rules) -> list:
    """Allow `rules` in the cgroup at `directory`; return exactly what was added.

    A rule one existing entry covers is skipped. Otherwise the whole rule is written (the
    kernel checks an access against one entry at a time, so a wildcard entry cannot lend the
    letters a specific one lacks) and the kernel merges it into an entry for the same device;
    what is returned, and later denied by `revoke`, is only the letters that entry did not
    have already: taking our grant back never takes away access the container had.
    """
    existing = current_rules(directory)
    added = []
    for rule in rules:
        if any(have.covers(rule) for have in existing):
            continue
        had = ""
        for have in existing:
            if have.allow and have.same_device(rule):
                had = union(had, have.access)
        try:
            _write(directory, "devices.allow", rule)
        except OSError as err:
            revoke(directory, added)
            raise ApplyError("cgroup", f"cannot allow {rule.v1_line()} in {directory}: {err.strerror}") from err
        added.append(rule.with_access(difference(rule.access, had)))
    if added:
        _verify(directory, rules, added)
    return added


def _verify(directory: str, rules, added: list) -> None:
    """Read devices.list back: every rule must now be allowed by one entry, or the grant is
    taken back and the start fails naming the first rule the kernel did not take."""
    try:
        now = current_rules(directory)
    except ApplyError:
        revoke(directory, added)
        raise
    for rule in rules:
        if not any(have.covers(rule) for have in now):
            problems = revoke(directory, added)
            raise ApplyError("cgroup", f"{directory}/devices.list does not allow {rule.v1_line()} after it was "
                                       f"written to devices.allow",
                             ("undo: " + "; ".join(problems)) if problems else None)


def revoke(directory: str, rules) -> list:
    """Deny `rules` again (used to undo `grant`); returns problems, never raises."""
    problems = []
    for rule in rules:
        if not rule.access:
            continue  # nothing of it was ours
        try:
            _write(directory, "devices.deny", rule)
        except OSError as err:
            problems.append(f"cannot deny {rule.v1_line()} in {directory}: {err.strerror}")
    return problems
