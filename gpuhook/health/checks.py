"""The checks: NVML's health facts and the processes' owners in, problems and remedies out.

A pure function of its inputs (`evaluate`), so every rule is tested with literal facts.
Each problem names its check, the evidence in words, and what could repair it:

    check           problem                                            remedy
    reachable       NVML reports the GPU lost (fallen off the bus)      none
    processes       an orphan (its container is gone)                   kill it
                    a zombie whose parent is an orphan                  kill the parent
                    a zombie whose parent is not                        none (only its parent can reap it)
                    a pid that no longer exists (context left behind)   reset
    memory          memory in use beyond the listed processes' share    reset
                    above leftover-memory-mib (the driver's own reserve
                    is not in use: NVML's v2 memory call reports it apart)
    ecc             volatile uncorrectable ECC errors                   reset
    retired-pages   page retirements pending                            reset
    remapped-rows   row remapping failed                                none (the GPU needs servicing)
                    row remaps pending                                  reset

Processes of live owners (containers, the host) are no problem; they make the GPU shared,
and the caller then never resets it (docs/health.md).
"""

from enum import Enum

from gpuhook.health.owners import Owner
from gpuhook.record import record

MIB = 1 << 20


class Check(str, Enum):
    REACHABLE = "reachable"
    PROCESSES = "processes"
    MEMORY = "memory"
    ECC = "ecc"
    RETIRED_PAGES = "retired-pages"
    REMAPPED_ROWS = "remapped-rows"


class Remedy(str, Enum):
    KILL = "kill"
    RESET = "reset"
    NONE = "none"


class Outcome(str, Enum):
    """A check's result in a report."""

    OK = "ok"
    FAILED = "failed"
    REPAIRED = "repaired"
    NOT_SUPPORTED = "not supported"  # the GPU cannot answer (ECC off, page retirement on Ampere, ...)
    NOT_DETERMINABLE = "not determinable"  # e.g. memory while NVML cannot tell a process's share
    NOT_RUN = "not run"  # the GPU is lost: nothing else can be asked


class Finding(record("Finding", "check remedy evidence targets")):
    """One problem. `targets` are the processes a KILL remedy kills (owners.Attributed for an
    orphan, the zombie's Attributed whose `reaper` is the parent to kill)."""

    __slots__ = ()


class Thresholds(record("Thresholds", "leftover_memory_mib")):
    __slots__ = ()

    @classmethod
    def from_config(cls, config) -> "Thresholds":
        return cls(config.health.leftover_memory_mib)


def evaluate(facts, processes, thresholds: Thresholds):
    """(problems, outcomes) for one GPU: `facts` is nvml.Health, `processes` the
    owners.Attributed of its processes. `outcomes` maps every Check to OK, FAILED or why it
    could not be judged; `problems` is a tuple of Finding."""
    if facts.lost:
        outcomes = {check: Outcome.NOT_RUN for check in Check}
        outcomes[Check.REACHABLE] = Outcome.FAILED
        lost = Finding(Check.REACHABLE, Remedy.NONE,
                       f"NVML reports the GPU lost (fallen off the bus) in {facts.lost_in}", ())
        return (lost,), outcomes
    problems = []
    outcomes = {Check.REACHABLE: Outcome.OK}

    found = list(_process_problems(processes))
    problems += found
    outcomes[Check.PROCESSES] = Outcome.FAILED if found else Outcome.OK

    leftover = _memory_problem(facts, processes, thresholds)
    if leftover is None:
        outcomes[Check.MEMORY] = Outcome.NOT_DETERMINABLE
    elif leftover:
        problems.append(leftover)
        outcomes[Check.MEMORY] = Outcome.FAILED
    else:
        outcomes[Check.MEMORY] = Outcome.OK

    for check, rule in ((Check.ECC, _ecc_problem), (Check.RETIRED_PAGES, _retired_pages_problem),
                        (Check.REMAPPED_ROWS, _remapped_rows_problem)):
        result = rule(facts)
        if result is None:
            outcomes[check] = Outcome.NOT_SUPPORTED
        elif result:
            problems.append(result)
            outcomes[check] = Outcome.FAILED
        else:
            outcomes[check] = Outcome.OK
    return tuple(problems), outcomes


def _process_problems(processes):
    for process in processes:
        if process.owner is Owner.ORPHAN:
            yield Finding(Check.PROCESSES, Remedy.KILL, f"pid {process.pid} ({process.kind}) is {process.detail}",
                          (process,))
        elif process.owner is Owner.ZOMBIE:
            remedy = Remedy.KILL if process.reaper is not None else Remedy.NONE
            yield Finding(Check.PROCESSES, remedy, f"pid {process.pid} ({process.kind}) is a {process.detail}",
                          (process,))
        elif process.owner is Owner.GONE:
            yield Finding(Check.PROCESSES, Remedy.RESET,
                          f"NVML lists pid {process.pid} ({process.kind}), which no longer exists: "
                          "a context left behind", ())


def _memory_problem(facts, processes, thresholds):
    """None when it cannot be judged; False when fine; else the Finding. `memory_used` leaves
    the driver's reserve out where the driver reports it apart (nvml.Health); on drivers
    before 510 it includes it, and leftover-memory-mib must leave room for it."""
    if facts.memory_used is None or any(p.used_memory is None for p in processes):
        return None
    listed = sum(p.used_memory for p in processes)
    leftover = facts.memory_used - listed
    if leftover <= thresholds.leftover_memory_mib * MIB:
        return False
    return Finding(Check.MEMORY, Remedy.RESET,
                   f"{_mib(leftover)} MiB in use beyond the {_mib(listed)} MiB of its "
                   f"{len(processes)} listed process(es) (leftover-memory-mib {thresholds.leftover_memory_mib})", ())


def _ecc_problem(facts):
    if facts.ecc is None:
        return None
    count = facts.ecc.volatile_uncorrected
    if not count:
        return False
    return Finding(Check.ECC, Remedy.RESET, f"{count} volatile uncorrectable ECC error(s) since the last reset", ())


def _retired_pages_problem(facts):
    pages = facts.retired_pages
    if pages is None:
        return None
    if not pages.pending:
        return False
    return Finding(Check.RETIRED_PAGES, Remedy.RESET,
                   f"page retirement pending a reset ({pages.single_bit} single-bit, {pages.double_bit} "
                   "double-bit pages retired)", ())


def _remapped_rows_problem(facts):
    rows = facts.remapped_rows
    if rows is None:
        return None
    if rows.failure:
        return Finding(Check.REMAPPED_ROWS, Remedy.NONE,
                       f"row remapping failed ({rows.uncorrectable} uncorrectable, {rows.correctable} "
                       "correctable rows remapped): the GPU needs servicing", ())
    if rows.pending:
        return Finding(Check.REMAPPED_ROWS, Remedy.RESET,
                       f"row remapping pending a reset ({rows.uncorrectable} uncorrectable, {rows.correctable} "
                       "correctable rows remapped)", ())
    return False


def _mib(value: int) -> int:
    return round(value / MIB)


def facts_summary(facts, processes) -> dict:
    """The facts behind a report, as plain data (docs/health.md, report format)."""
    if facts.lost:
        return {"lost": True, "lost_in": facts.lost_in}
    summary = {
        "lost": False,
        "memory_total_mib": None if facts.memory_total is None else _mib(facts.memory_total),
        "memory_used_mib": None if facts.memory_used is None else _mib(facts.memory_used),
        "memory_reserved_mib": None if facts.memory_reserved is None else _mib(facts.memory_reserved),
        "processes": [{"pid": p.pid, "kind": p.kind, "owner": p.owner.value, "detail": p.detail,
                       "used_memory_mib": None if p.used_memory is None else _mib(p.used_memory)}
                      for p in processes],
    }
    if facts.ecc is not None:
        summary["ecc"] = dict(facts.ecc._asdict())
    if facts.retired_pages is not None:
        summary["retired_pages"] = dict(facts.retired_pages._asdict())
    if facts.remapped_rows is not None:
        summary["remapped_rows"] = dict(facts.remapped_rows._asdict())
    return summary
