"""The decision log's line bound (gpuhook.journal.line_bytes): what a too-long line keeps."""

import json

from gpuhook import journal

GPUS = [f"GPU-{i:08x}-0000-4000-8000-000000000000" for i in range(16)]


def health_report(detail: int) -> dict:
    return {"mode": "fallback", "daemon": "no health daemon",
            "gpus": [{"uuid": uuid, "status": "unhealthy" if i == 3 else "healthy", "seconds": 0.25,
                      "checks": {c: "ok" for c in ("reachable", "processes", "memory", "ecc", "remapped-rows")},
                      "facts": {"memory_used": 1 << 30, "detail": "x" * detail}, "actions": [{"action": "kill"}]}
                     for i, uuid in enumerate(GPUS)]}


def line(record) -> dict:
    data = journal.line_bytes(record)
    assert len(data) <= journal.MAX_LINE_BYTES and data.endswith(b"\n")
    return json.loads(data)


def test_a_16_gpu_health_report_keeps_each_gpus_status():
    record = {"stage": "prestart", "container": "c1", "decision": "failed", "error": f"{GPUS[3]} failed its ecc check",
              "gpus": GPUS, "notes": ["a note"], "health": health_report(400)}
    doc = line(record)
    assert [(g["uuid"], g["status"]) for g in doc["health"]["gpus"]] == \
        [(uuid, "unhealthy" if i == 3 else "healthy") for i, uuid in enumerate(GPUS)]
    assert doc["health"]["mode"] == "fallback" and "checks" not in doc["health"]["gpus"][0]
    assert doc["notes"] == ["a note"] and doc["truncated"].endswith("health kept shallow")


def test_fields_still_too_big_when_shallow_are_dropped_biggest_first():
    record = {"stage": "prestart", "container": "c1", "decision": "gpus injected", "gpus": GPUS[:1],
              "ldconfig_output": "y" * 400, "extra": [f"{i:04d}" * 100 for i in range(40)], "notes": ["kept"]}
    doc = line(record)
    assert "extra" not in doc and doc["notes"] == ["kept"] and doc["ldconfig_output"] == "y" * 400
    assert doc["truncated"].endswith(": extra dropped")


def test_a_line_that_fits_is_written_whole():
    record = {"stage": "prestart", "container": "c1", "decision": "gpus injected", "health": health_report(10)}
    record["health"]["gpus"] = record["health"]["gpus"][:2]
    assert line(record) == {**json.loads(json.dumps(record))}


def test_ldconfigs_output_is_kept_to_its_own_limit_other_strings_to_512():
    """ldconfig's output is the only record of what it met: kept to 4096 characters, where
    another string keeps 512 (attacker pass 13). Only at the top level of the line."""
    output = "x" * 5000
    line = json.loads(journal.line_bytes({"ldconfig_output": output, "error": output, "nested": {"ldconfig_output": output}}))
    assert line["ldconfig_output"].startswith("x" * 4096 + "...(+904 chars)")
    assert line["error"] == "x" * 512 + "...(+4488 chars)"
    assert line["nested"]["ldconfig_output"] == "x" * 512 + "...(+4488 chars)"
