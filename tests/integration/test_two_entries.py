"""One start that carries gpuhook twice (docs/packaging.md, "containerd": a base spec's prestart
and a CDI spec's createRuntime, and both poststops), in real runc: the first entry of each kind
does the work, the other is a no-op (gpuhook.apply.served)."""

import pytest
from helpers.runtimes import gpu_nodes, log_records, registered
from helpers import testbed


pytestmark = pytest.mark.root


def twice(config):
    def edit(spec):
        spec["hooks"] = {"prestart": [testbed.hook_entry(config, "prestart")],
                         "createRuntime": [testbed.hook_entry(config, "createRuntime")],
                         "poststop": [testbed.hook_entry(config, "poststop"), testbed.hook_entry(config, "poststop")]}
    return edit


def test_a_start_that_runs_gpuhook_twice_is_served_once_and_cleaned_up_once(gpus):
    gpus.configure(health={"mode": "always"})
    result = gpus.run("twice", env=["NVIDIA_VISIBLE_DEVICES=1"], hook=False, edit=twice(gpus.config))
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {"/dev/nvidia1"}
    (first,) = log_records(gpus, "prestart")
    (second,) = log_records(gpus, "createRuntime")
    assert first["decision"] == "gpus injected" and first["health"]["purpose"] == "prestart"
    assert second["decision"] == "untouched: gpuhook's prestart hook already served this start"
    assert "health" not in second and "gpus" not in second and second["nvml"] == "not loaded"
    stops = log_records(gpus, "poststop")
    assert [s["decision"] for s in stops] == \
        ["cleaned up", "nothing to do: another poststop hook of this container already cleaned up"]
    assert "health" not in stops[1] and "grants" not in stops[1]
    assert not registered(gpus, "twice")


def test_a_new_start_of_the_same_id_is_served_again(gpus):
    """The record names the init (pid and start time), not the id: the next start of a
    container of the same id gets its GPU, and its own single cleanup."""
    gpus.configure(health={"mode": "always"})
    for _ in range(2):
        result = gpus.run("again", env=["NVIDIA_VISIBLE_DEVICES=0"], hook=False, edit=twice(gpus.config))
        assert result.returncode == 0, result.stderr
        assert gpu_nodes(result.probes()) == {"/dev/nvidia0"}
    assert [r["decision"] for r in log_records(gpus, "prestart")] == ["gpus injected"] * 2
    assert [r["decision"].split(":")[0] for r in log_records(gpus, "createRuntime")] == ["untouched"] * 2
    assert [r["decision"].split(":")[0] for r in log_records(gpus, "poststop")] == \
        ["cleaned up", "nothing to do"] * 2
