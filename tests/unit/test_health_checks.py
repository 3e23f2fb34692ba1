"""gpuhook.health.checks: the rules, fed literal NVML facts and process owners (no NVML here)."""

import pytest

from gpuhook import config as cfg
from gpuhook.errors import ConfigError
from gpuhook.health import checks, registry
from gpuhook.health.checks import Check, Outcome, Remedy
from gpuhook.health.owners import Attributed, Owner
from gpuhook.discover.nvml import EccCounts, Health, RemappedRows, RetiredPages

MIB = 1 << 20
UUID = "GPU-11111111-2222-3333-4444-555555555555"
THRESHOLDS = checks.Thresholds(leftover_memory_mib=1024)
DEAD = registry.Container("c0ffee", 4000, 77, {"pids": "/c0ffee"}, (UUID,), {}, "boot", 1.0)


def facts(**changes) -> Health:
    """A healthy Ampere-like GPU (ECC and row remapping, no page retirement), then `changes`."""
    healthy = Health(uuid=UUID, lost=False, lost_in=None, processes=(), memory_total=80 << 30, memory_used=0,
                     ecc=EccCounts(0, 0, 3, 0), retired_pages=None, remapped_rows=RemappedRows(0, 0, False, False))
    return healthy._replace(**changes)


def process(pid, owner, used=1 << 30, container=None, reaper=None, detail="") -> Attributed:
    return Attributed(pid, "compute", used, owner, container, 1234, reaper, detail or owner.value)


def problems_of(health, processes=()):
    return checks.evaluate(health, processes, THRESHOLDS)


def test_a_healthy_gpu_has_no_problem_and_says_what_it_could_not_ask():
    found, outcomes = problems_of(facts())
    assert found == ()
    assert outcomes == {Check.REACHABLE: Outcome.OK, Check.PROCESSES: Outcome.OK, Check.MEMORY: Outcome.OK,
                        Check.ECC: Outcome.OK, Check.RETIRED_PAGES: Outcome.NOT_SUPPORTED,
                        Check.REMAPPED_ROWS: Outcome.OK}


@pytest.mark.parametrize("change,check,remedy,evidence", [
    ({"ecc": EccCounts(0, 2, 0, 2)}, Check.ECC, Remedy.RESET,
     "2 volatile uncorrectable ECC error(s) since the last reset"),
    ({"retired_pages": RetiredPages(3, 1, True), "remapped_rows": None}, Check.RETIRED_PAGES, Remedy.RESET,
     "page retirement pending a reset (3 single-bit, 1 double-bit pages retired)"),
    ({"remapped_rows": RemappedRows(2, 1, True, False)}, Check.REMAPPED_ROWS, Remedy.RESET,
     "row remapping pending a reset (1 uncorrectable, 2 correctable rows remapped)"),
    ({"remapped_rows": RemappedRows(0, 5, True, True)}, Check.REMAPPED_ROWS, Remedy.NONE,
     "row remapping failed (5 uncorrectable, 0 correctable rows remapped): the GPU needs servicing"),
    ({"memory_used": 3 << 30}, Check.MEMORY, Remedy.RESET,
     "3072 MiB in use beyond the 0 MiB of its 0 listed process(es) (leftover-memory-mib 1024)"),
    ({"lost": True, "lost_in": "nvmlDeviceGetHandleByUUID", "processes": None, "memory_used": None, "ecc": None,
      "remapped_rows": None}, Check.REACHABLE, Remedy.NONE,
     "NVML reports the GPU lost (fallen off the bus) in nvmlDeviceGetHandleByUUID"),
])
def test_each_fault_is_one_problem_with_its_remedy_and_evidence(change, check, remedy, evidence):
    found, outcomes = problems_of(facts(**change))
    assert [(f.check, f.remedy, f.evidence) for f in found] == [(check, remedy, evidence)]
    assert outcomes[check] is Outcome.FAILED


def test_a_lost_gpu_is_asked_nothing_else():
    _, outcomes = problems_of(facts(lost=True, lost_in="nvmlDeviceGetMemoryInfo"))
    assert {c: o for c, o in outcomes.items() if c is not Check.REACHABLE} == \
           {c: Outcome.NOT_RUN for c in Check if c is not Check.REACHABLE}


def test_corrected_and_aggregate_ecc_errors_need_no_reset():
    assert problems_of(facts(ecc=EccCounts(500, 0, 900, 12)))[0] == ()


def test_ecc_off_is_not_supported_rather_than_healthy():
    assert problems_of(facts(ecc=None))[1][Check.ECC] is Outcome.NOT_SUPPORTED


def test_memory_of_listed_processes_is_no_leftover_and_the_threshold_is_inclusive():
    owners = (process(10, Owner.CONTAINER, used=20 << 30),)
    assert problems_of(facts(memory_used=(20 << 30) + 1024 * MIB, processes=owners), owners)[0] == ()
    found, _ = problems_of(facts(memory_used=(20 << 30) + 1025 * MIB), owners)
    assert found[0].evidence.startswith("1025 MiB in use beyond the 20480 MiB of its 1 listed process(es)")


def test_memory_cannot_be_judged_when_nvml_cannot_tell_a_process_share():
    owners = (process(10, Owner.CONTAINER, used=None),)
    found, outcomes = problems_of(facts(memory_used=60 << 30), owners)
    assert found == () and outcomes[Check.MEMORY] is Outcome.NOT_DETERMINABLE


def test_processes_of_live_owners_are_no_problem():
    owners = tuple(process(10 + i, owner) for i, owner in enumerate((Owner.CONTAINER, Owner.OTHER_CONTAINER,
                                                                      Owner.HOST)))
    found, outcomes = problems_of(facts(memory_used=3 << 30), owners)
    assert found == () and outcomes[Check.PROCESSES] is Outcome.OK


def test_process_problems_name_the_pid_and_what_repairs_them():
    reaper = registry.ProcessStat(61, "S", 1, 99, 0)
    owners = (
        process(60, Owner.ORPHAN, container=DEAD, detail="left over from container c0ffee, whose init (pid 4000) is gone"),
        process(62, Owner.ZOMBIE, container=DEAD, reaper=reaper, detail="zombie whose parent pid 61 is left over"),
        process(63, Owner.ZOMBIE, detail="zombie not reaped by its parent pid 1 (host process)"),
        process(64, Owner.GONE),
    )
    found, outcomes = problems_of(facts(memory_used=4 << 30), owners)
    assert [(f.remedy, f.evidence) for f in found] == [
        (Remedy.KILL, "pid 60 (compute) is left over from container c0ffee, whose init (pid 4000) is gone"),
        (Remedy.KILL, "pid 62 (compute) is a zombie whose parent pid 61 is left over"),
        (Remedy.NONE, "pid 63 (compute) is a zombie not reaped by its parent pid 1 (host process)"),
        (Remedy.RESET, "NVML lists pid 64 (compute), which no longer exists: a context left behind"),
    ]
    assert found[0].targets == (owners[0],) and found[1].targets[0].reaper == reaper
    assert outcomes[Check.PROCESSES] is Outcome.FAILED
    assert outcomes[Check.MEMORY] is Outcome.OK  # all 4 GiB belong to listed processes


def test_facts_summary_is_plain_data_in_mib():
    owners = (process(10, Owner.HOST, used=512 * MIB),)
    summary = checks.facts_summary(facts(memory_used=600 * MIB), owners)
    assert summary["memory_used_mib"] == 600 and summary["memory_total_mib"] == 81920
    assert summary["processes"] == [{"pid": 10, "kind": "compute", "owner": "host", "detail": "host",
                                     "used_memory_mib": 512}]
    assert "retired_pages" not in summary and summary["remapped_rows"]["pending"] is False


# --- the [health] configuration section -----------------------------------------------------

def test_health_defaults():
    health = cfg.defaults().health
    assert (health.mode, health.deadline_seconds, health.on_failure, health.leftover_memory_mib) == \
           ("fallback", 10.0, "fail", 1024)
    assert (health.reset_command, health.reset_timeout_seconds, health.kill_orphans, health.stamp_ttl_seconds,
            health.reset_on_release) == ("nvidia-smi --gpu-reset -i {uuid}", 8.0, True, 60.0, False)


@pytest.mark.parametrize("values,message", [
    ({"mode": "sometimes"}, "health.mode must be one of off, fallback, always"),
    ({"on-failure": "ignore"}, "health.on-failure must be one of fail, warn"),
    ({"deadline-seconds": 0}, "health.deadline-seconds must be a number of seconds"),
    ({"leftover-memory-mib": -1}, "health.leftover-memory-mib must be a whole number"),
    ({"kill-orphans": "yes"}, "health.kill-orphans must be true or false"),
    ({"reset-timeout": 3}, "unknown key health.reset-timeout"),
])
def test_bad_health_values_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message):
        cfg.from_mapping({"health": values})
