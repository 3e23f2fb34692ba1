"""What a stopped container's cgroup v1 grant gives back (gpuhook.apply.grants.to_take_back):
exactly the access letters no live container sharing the cgroup was granted."""

from gpuhook.apply import grants


def grant(planned, added=None):
    return grants.Grant({"id": "c", "pid": 1, "start_time": 1, "boot_id": "b", "directory": "/d",
                         "cgroup": [1, 2], "planned": planned, "added": planned if added is None else added})


def lines(rules):
    return [rule.v1_line() for rule in rules]


def test_a_device_nobody_else_was_granted_is_taken_back_whole():
    assert lines(grants.to_take_back(grant(["c 195:0 rw", "c 195:255 rw"]), [])) == ["c 195:0 rw", "c 195:255 rw"]


def test_letters_another_live_container_planned_stay_and_only_those():
    stopped = grant(["c 195:0 rw", "c 195:1 rw", "c 195:255 rw"])
    reader = grant(["c 195:0 r", "c 195:255 rw"])  # given GPU 0 read-only by its runtime
    assert lines(grants.to_take_back(stopped, [reader])) == ["c 195:0 w", "c 195:1 rw"]


def test_only_what_the_stopped_container_added_is_ever_denied():
    stopped = grant(["c 195:0 rw", "c 195:1 rw"], added=["c 195:1 w"])  # the cgroup had the rest already
    assert lines(grants.to_take_back(stopped, [])) == ["c 195:1 w"]


def test_a_format_1_entry_has_no_cgroup_identity_and_is_taken_back_by_path():
    old = grants.Grant({"id": "c", "pid": 1, "start_time": 1, "boot_id": "b", "directory": "/",
                        "planned": [], "added": []})
    assert old.cgroup is None and old.same_cgroup()
    moved = grant([])
    moved.directory = "/"
    assert not moved.same_cgroup()  # "/" exists, but it is not the cgroup the grant was made in


def test_the_stopping_containers_own_records_are_read_whatever_the_bound(tmp_path, monkeypatch):
    """Attacker pass 7 (A4): 4096 records of other containers sorting first hid the stopping
    container's own, so its grant was never taken back."""
    import json
    import os

    from gpuhook.kernel import files

    state = tmp_path / "state"
    (state / "grants").mkdir(parents=True)
    doc = {"format": 2, "pid": 1, "start_time": 1, "boot_id": files.boot_id(), "mode": "v1", "directory": "/d",
           "cgroup": [1, 2], "planned": [], "added": []}
    for name in ("a", "b", "c", "zz"):
        (state / "grants" / f"{name}@1-1.json").write_text(json.dumps({**doc, "id": name}))
    os.chmod(state / "grants", 0o700)
    monkeypatch.setattr(grants, "MAX_ENTRIES", 2)
    ids = [g.id for g in grants._load(str(state), "zz")]
    assert "zz" in ids and len(ids) == 2
    assert [g.id for g in grants._load(str(state))] == ["a", "b"]
