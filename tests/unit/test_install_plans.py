"""`gpuhook install` / `gpuhook uninstall` on files in temp dirs: every target's dry run.

The tests of it that need no root; those that do are in tests/integration/test_install.py.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
import tomllib
import pytest
from conftest import REPO, require
from helpers.runtimes import gpuhook_cli
from gpuhook import install
from gpuhook.errors import ConfigError


LAUNCHER = os.path.join(REPO, "gpuhook", "launch.py")


CRI_RUNC = install.RUNC_TABLE_PATH


# The hooks.d files gpuhook install writes, one per stage.
HOOK_FILES = {"prestart": "gpuhook.json", "poststop": "gpuhook-poststop.json"}


def snapshot(root) -> dict:
    """Every file under `root`: relative path -> bytes."""
    found = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            found[os.path.relpath(path, root)] = open(path, "rb").read()
    return found


def write(path, text) -> str:
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def sim_config(tmp_path, deadline=None) -> str:
    return write(tmp_path / "gpuhook.toml", "" if deadline is None else f"deadline-seconds = {deadline}\n")


def apply_install(target, **options):
    return install.apply(install.plan_install(target, environ={}, **options))


def apply_uninstall(target, **options):
    return install.apply(install.plan_uninstall(target, **options))


def one_line_error(done, *fragments):
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("gpuhook: "), done.stderr
    for fragment in fragments:
        assert fragment in done.stderr, done.stderr


def diff_files(diff: str) -> dict:
    """A unified diff of new files (--- /dev/null): target path -> the lines it adds."""
    files, current = {}, None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            current = files.setdefault(line[4:], [])
        elif line.startswith("+") and current is not None:
            current.append(line[1:])
        elif line.startswith("--- "):
            assert line == "--- /dev/null", line
            current = None
    return files


def expected_hooks_d_document(stage, config, when=None) -> dict:
    """The oci-hooks document gpuhook install writes for `stage`, spelled out."""
    return {
        "version": "1.0.0",
        "hook": {"path": sys.executable,
                 "args": [sys.executable, "-I", "-S", LAUNCHER, stage, "--config", config],
                 "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
                 "timeout": 30},
        "when": when or {"always": True},
        "stages": [stage],
    }


def test_podman_hooks_files_run_this_installation_with_fast_flags_and_a_minimal_env(tmp_path):
    config = sim_config(tmp_path)
    done = apply_install("podman", hooks_dir=str(tmp_path / "hooks.d"), config_path=config)
    assert done == [f"created {tmp_path}/hooks.d/{name}" for name in HOOK_FILES.values()]
    assert sorted(os.listdir(tmp_path / "hooks.d")) == sorted(HOOK_FILES.values())
    for stage, name in HOOK_FILES.items():
        path = tmp_path / "hooks.d" / name
        assert json.loads(path.read_text()) == expected_hooks_d_document(stage, config), name
        assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_dry_run_prints_the_exact_new_files_and_changes_nothing(tmp_path):
    hooks_dir = tmp_path / "hooks.d"
    config = sim_config(tmp_path)
    done = gpuhook_cli("install", "podman", "--hooks-dir", str(hooks_dir), "--config", config, "--dry-run")
    assert not hooks_dir.exists()
    shown = diff_files(done.stdout)
    assert list(shown) == [f"{hooks_dir}/{name}" for name in HOOK_FILES.values()]
    gpuhook_cli("install", "podman", "--hooks-dir", str(hooks_dir), "--config", config)
    for path, lines in shown.items():
        assert open(path).read().splitlines() == lines, path


def test_install_twice_changes_nothing_the_second_time(tmp_path):
    hooks_dir = tmp_path / "hooks.d"
    config = sim_config(tmp_path)
    gpuhook_cli("install", "podman", "--hooks-dir", str(hooks_dir), "--config", config)
    before = snapshot(tmp_path)
    mtimes = [(hooks_dir / name).stat().st_mtime_ns for name in HOOK_FILES.values()]
    done = gpuhook_cli("install", "podman", "--hooks-dir", str(hooks_dir), "--config", config)
    assert done.stdout.splitlines()[:2] == [f"unchanged {hooks_dir}/{name}" for name in HOOK_FILES.values()]
    assert snapshot(tmp_path) == before
    assert [(hooks_dir / name).stat().st_mtime_ns for name in HOOK_FILES.values()] == mtimes
    dry = gpuhook_cli("install", "podman", "--hooks-dir", str(hooks_dir), "--config", config, "--dry-run")
    assert dry.stdout.splitlines()[:2] == [f"# {hooks_dir}/{name}: unchanged" for name in HOOK_FILES.values()]


@pytest.mark.parametrize("theirs", [("gpuhook.json",), ("gpuhook-poststop.json",),
                                    ("gpuhook.json", "gpuhook-poststop.json")],
                         ids=["prestart-file", "poststop-file", "both"])
def test_a_users_hooks_files_are_backed_up_and_uninstall_restores_them(tmp_path, theirs):
    hooks_dir = tmp_path / "hooks.d"
    mine = {name: '{"version": "1.0.0", "hook": {"path": "/usr/local/bin/my-hook"}, "when": {"always": true}, '
                  f'"stages": ["{stage}"]}}' for stage, name in HOOK_FILES.items() if name in theirs}
    for name, text in mine.items():
        write(hooks_dir / name, text)
    write(hooks_dir / "other.json", "{}")
    done = apply_install("podman", hooks_dir=str(hooks_dir))
    for name in HOOK_FILES.values():
        backed_up = f"backed up {hooks_dir}/{name} to {hooks_dir}/{name}.gpuhook-bak"
        assert (backed_up in done) == (name in mine), name
        assert install.is_gpuhook_entry(json.loads((hooks_dir / name).read_text())["hook"])
    for name, text in mine.items():
        assert (hooks_dir / f"{name}.gpuhook-bak").read_text() == text
    assert (hooks_dir / "other.json").read_text() == "{}"

    apply_uninstall("podman", hooks_dir=str(hooks_dir))
    assert snapshot(hooks_dir) == {**{name: text.encode() for name, text in mine.items()}, "other.json": b"{}"}


def test_reinstalling_over_gpuhooks_own_files_needs_no_backup_and_uninstall_deletes_them(tmp_path):
    hooks_dir = str(tmp_path / "hooks.d")
    apply_install("podman", hooks_dir=hooks_dir)
    done = apply_install("podman", hooks_dir=hooks_dir, config_path=sim_config(tmp_path, deadline=50))
    assert done == [f"updated {hooks_dir}/{name}" for name in HOOK_FILES.values()]
    for name in HOOK_FILES.values():
        assert json.loads(open(f"{hooks_dir}/{name}").read())["hook"]["timeout"] == 55  # deadline + 5
    assert apply_uninstall("podman", hooks_dir=hooks_dir) == [f"removed {hooks_dir}/{name}"
                                                               for name in HOOK_FILES.values()]
    assert os.listdir(hooks_dir) == []
    plan = install.plan_uninstall("podman", hooks_dir=hooks_dir)
    assert plan.changes == ()
    assert plan.notes == tuple(f"{hooks_dir}/{name} does not exist: nothing to remove" for name in HOOK_FILES.values())


def test_uninstall_of_an_install_without_the_poststop_file_removes_the_prestart_file(tmp_path):
    """What an install older than the poststop stage left: gpuhook.json only."""
    hooks_dir = tmp_path / "hooks.d"
    hook = install.Hook(sys.executable, LAUNCHER)
    write(hooks_dir / "gpuhook.json", install.render_json(install.hooks_d_document(hook)))
    plan = install.plan_uninstall("podman", hooks_dir=str(hooks_dir))
    assert f"{hooks_dir}/gpuhook-poststop.json does not exist: nothing to remove" in plan.notes
    assert install.apply(plan) == [f"removed {hooks_dir}/gpuhook.json"]
    assert os.listdir(hooks_dir) == []


@pytest.mark.parametrize("foreign,ours", [("gpuhook.json", "gpuhook-poststop.json"),
                                          ("gpuhook-poststop.json", "gpuhook.json")])
def test_uninstall_leaves_hooks_files_alone_when_one_does_not_run_gpuhook(tmp_path, foreign, ours):
    hooks_dir = tmp_path / "hooks.d"
    path = write(hooks_dir / foreign, '{"hook": {"path": "/bin/true"}}')
    done = gpuhook_cli("uninstall", "podman", "--hooks-dir", str(hooks_dir), check=False)
    one_line_error(done, f"{path} does not run gpuhook; leaving it alone")
    assert open(path).read() == '{"hook": {"path": "/bin/true"}}'
    # With gpuhook's other file next to it, nothing is changed either: the plan stops first.
    stage = next(stage for stage, name in HOOK_FILES.items() if name == ours)
    text = install.render_json(install.hooks_d_document(install.Hook(sys.executable, LAUNCHER), stage=stage))
    write(hooks_dir / ours, text)
    before = snapshot(tmp_path)
    one_line_error(gpuhook_cli("uninstall", "podman", "--hooks-dir", str(hooks_dir), check=False),
                   f"{path} does not run gpuhook")
    assert snapshot(tmp_path) == before


def test_annotated_variant_gates_both_stages_on_nvidia_cdi_annotations(tmp_path):
    config = sim_config(tmp_path)
    apply_install("crio", hooks_dir=str(tmp_path / "hooks.d"), annotated=True, config_path=config)
    when = {"annotations": {r"^cdi\.k8s\.io/.*$": r"(nvidia\.com/[a-zA-Z0-9_.-]+|gpuhook\.example/gpu)="}}
    import re

    for value in ("nvidia.com/gpu=1", "k8s.device-plugin.nvidia.com/gpu=GPU-1", "k8s.gpu.nvidia.com/claim=u-gpu-0",
                  "gpuhook.example/gpu=1"):  # every kind the hook's CDI-annotation channel accepts
        assert re.search(when["annotations"][r"^cdi\.k8s\.io/.*$"], value), value
    assert not re.search(when["annotations"][r"^cdi\.k8s\.io/.*$"], "vendor.com/nic=eth0")
    for stage, name in HOOK_FILES.items():
        doc = json.loads((tmp_path / "hooks.d" / name).read_text())
        assert doc == expected_hooks_d_document(stage, config, when), name


def test_crio_and_admin_dir_notes_say_what_the_runtime_reads(tmp_path):
    packaged = {name: write(tmp_path / "share" / name, "{}") for name in HOOK_FILES.values()}
    hook = install.Hook(sys.executable, LAUNCHER)
    plan = install.plan_hooks_d("crio", str(tmp_path / "etc"), hook, package_hooks_dir=str(tmp_path / "share"))
    assert any("hooks_dir" in note and str(tmp_path / "etc") in note for note in plan.notes)
    plan = install.plan_hooks_d("podman", install.ADMIN_HOOKS_DIR, hook, package_hooks_dir=str(tmp_path / "share"))
    for name, path in packaged.items():
        assert f"{install.ADMIN_HOOKS_DIR}/{name} overrides the packaged {path} (same file name)" in plan.notes


def test_podman_in_another_hooks_dir_is_told_to_be_given_that_dir(tmp_path):
    """install podman --hooks-dir DIR said 'podman reads the hooks dir at every container start;
    nothing to restart', but podman reads only its default dirs unless given DIR."""
    hook = install.Hook(sys.executable, LAUNCHER)
    other = str(tmp_path / "hooks.d")
    notes = install.plan_hooks_d("podman", other, hook, package_hooks_dir=str(tmp_path / "share")).notes
    assert not any("nothing to restart" in note for note in notes), notes
    assert any(f"--hooks-dir {other}" in note and "containers.conf" in note for note in notes), notes
    for default in (install.ADMIN_HOOKS_DIR, install.PACKAGE_HOOKS_DIR):
        notes = install.plan_hooks_d("podman", default, hook).notes
        assert "podman reads the hooks dir at every container start; nothing to restart" in notes, notes
    # install --host-root writes under the node's root: what counts is the dir as podman sees it.
    notes = install.plan_hooks_d("podman", str(tmp_path / "host" / "etc" / "containers" / "oci" / "hooks.d"), hook,
                                 runtime_dir=install.ADMIN_HOOKS_DIR).notes
    assert "podman reads the hooks dir at every container start; nothing to restart" in notes, notes


def test_crio_installs_by_default_where_crio_reads_hooks_by_default():
    """CRI-O's default hooks_dir is /usr/share/containers/oci/hooks.d only; install crio used to
    write into /etc/containers/oci/hooks.d, which CRI-O never reads unless configured."""
    plan = install.plan_install("crio", environ={})
    assert {os.path.dirname(change.path) for change in plan.changes} == {install.PACKAGE_HOOKS_DIR}
    plan = install.plan_install("podman", environ={})
    assert {os.path.dirname(change.path) for change in plan.changes} == {install.ADMIN_HOOKS_DIR}


def test_the_hooks_file_takes_its_config_from_the_environment_as_an_absolute_path(tmp_path, monkeypatch):
    sim_config(tmp_path)
    monkeypatch.chdir(tmp_path)
    hook = install.this_installation(environ={"GPUHOOK_CONFIG": "gpuhook.toml"})
    assert hook.entry()["args"][-2:] == ["--config", str(tmp_path / "gpuhook.toml")]
    assert install.this_installation(environ={}).config is None


def test_a_missing_or_invalid_config_stops_install_before_anything_is_written(tmp_path):
    done = gpuhook_cli("install", "podman", "--hooks-dir", str(tmp_path / "h"), "--config",
                       str(tmp_path / "missing.toml"), check=False)
    one_line_error(done, f"config file {tmp_path}/missing.toml does not exist")
    with pytest.raises(ConfigError, match="deadline-seconds"):
        install.this_installation(config_path=write(tmp_path / "bad.toml", "deadline-seconds = -1\n"))
    assert not (tmp_path / "h").exists()


@pytest.mark.parametrize("make,message", [
    (lambda d: write(d / "shim", "#!/usr/bin/env bash\nexec python3 \"$@\"\n"), "is a script (a pyenv shim?)"),
    (lambda d: "/bin/true", "is not Python 3.11 or newer"),
    (lambda d: "python3", "is not an absolute path"),
    (lambda d: str(d / "nonexistent"), "No such file or directory"),
])
def test_the_interpreter_must_be_an_absolute_python_binary(tmp_path, make, message):
    python = make(tmp_path)
    if python.startswith(str(tmp_path)) and os.path.exists(python):
        os.chmod(python, 0o755)
    done = gpuhook_cli("install", "podman", "--hooks-dir", str(tmp_path / "h"), "--python", python, check=False)
    one_line_error(done, message)
    assert not (tmp_path / "h").exists()


SHIPPED_HOOKS_FILES = {  # hooks.d/NAME -> (stage, annotated)
    "gpuhook.json": ("prestart", False), "gpuhook-poststop.json": ("poststop", False),
    "gpuhook-annotated.json": ("prestart", True), "gpuhook-poststop-annotated.json": ("poststop", True)}


def test_shipped_hooks_files_are_what_the_packages_register():
    assert sorted(os.listdir(os.path.join(REPO, "hooks.d"))) == sorted(SHIPPED_HOOKS_FILES)
    docs = {}
    for name, (stage, annotated) in SHIPPED_HOOKS_FILES.items():
        with open(os.path.join(REPO, "hooks.d", name)) as f:
            shipped = f.read()
        packaged = install.packaged_hook(front=install.PACKAGED_FRONT)
        assert shipped == install.render_json(install.hooks_d_document(packaged, annotated, stage)), name
        docs[name] = json.loads(shipped)
        hook = docs[name]["hook"]
        # The native front runs the Python command that follows it (native/prescan.c).
        assert hook["path"] == "/usr/libexec/gpuhook/gpuhook-front" and hook["timeout"] == 30
        assert hook["env"] == ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
        assert hook["args"] == ["/usr/libexec/gpuhook/gpuhook-front", "/usr/bin/python3", "-I", "-S",
                                "/usr/lib/python3/dist-packages/gpuhook/launch.py", stage]
        assert docs[name]["stages"] == [stage]
    assert docs["gpuhook.json"]["when"] == docs["gpuhook-poststop.json"]["when"] == {"always": True}
    assert docs["gpuhook-annotated.json"]["when"] == docs["gpuhook-poststop-annotated.json"]["when"] == \
        {"annotations": dict(install.CDI_WHEN)}


def test_only_the_stages_gpuhook_registers_are_written():
    hook = install.packaged_hook()
    with pytest.raises(ValueError, match="no 'createRuntime' stage"):
        install.hooks_d_document(hook, stage="createRuntime")
    # A single entry where a stage -> entry mapping belongs must not become hooks named "path", "args"...
    with pytest.raises(ValueError, match="entries must map stages"):
        install.with_hook({}, hook.entry(), "test")


USER_HOOK = {"path": "/usr/local/bin/net-setup", "args": ["net-setup", "up"]}


USER_POSTSTOP = {"path": "/bin/true"}


def gpuhook_entry(stage, config=None) -> dict:
    """The hook entry gpuhook install writes for `stage`, spelled out."""
    args = [sys.executable, "-I", "-S", LAUNCHER, stage] + (["--config", config] if config else [])
    return {"path": sys.executable, "args": args, "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "timeout": 30}


def bundle_with_config(tmp_path) -> tuple:
    """A bundle whose config.json is tab-indented (like `runc spec`) and has its own hooks."""
    doc = {"ociVersion": "1.0.2-dev", "process": {"args": ["sh"]}, "root": {"path": "rootfs"},
           "hooks": {"prestart": [USER_HOOK], "poststop": [USER_POSTSTOP]}}
    text = json.dumps(doc, indent="\t") + "\n"
    return str(tmp_path / "bundle"), write(tmp_path / "bundle" / "config.json", text), text


def test_bundle_gets_gpuhook_after_its_own_hooks_keeping_its_layout_and_a_backup(tmp_path):
    bundle, path, original = bundle_with_config(tmp_path)
    config = sim_config(tmp_path)
    apply_install("runc-bundle", bundle=bundle, config_path=config)
    text = open(path).read()
    doc = json.loads(text)
    assert doc["hooks"] == {"prestart": [USER_HOOK, gpuhook_entry("prestart", config)],
                            "poststop": [USER_POSTSTOP, gpuhook_entry("poststop", config)]}
    assert text.splitlines()[1].startswith("\t\"") and text.endswith("}\n")
    assert open(path + ".gpuhook-bak").read() == original

    before = snapshot(tmp_path)
    assert apply_install("runc-bundle", bundle=bundle, config_path=config) == [f"unchanged {path}"]
    assert snapshot(tmp_path) == before
    apply_install("runc-bundle", bundle=bundle)  # another config: the entries are replaced in place
    hooks = json.loads(open(path).read())["hooks"]
    assert hooks == {"prestart": [USER_HOOK, gpuhook_entry("prestart")],
                     "poststop": [USER_POSTSTOP, gpuhook_entry("poststop")]}
    assert open(path + ".gpuhook-bak").read() == original

    apply_uninstall("runc-bundle", bundle=bundle)
    assert snapshot(bundle) == {"config.json": original.encode()}


def test_bundle_uninstall_keeps_later_user_changes_and_the_backup(tmp_path):
    bundle, path, original = bundle_with_config(tmp_path)
    apply_install("runc-bundle", bundle=bundle)
    doc = json.loads(open(path).read())
    doc["process"]["args"] = ["sh", "-c", "changed"]
    write(path, json.dumps(doc, indent="\t") + "\n")
    plan = install.plan_uninstall("runc-bundle", bundle=bundle)
    assert any("changed since gpuhook install" in note for note in plan.notes)
    install.apply(plan)
    doc = json.loads(open(path).read())
    assert doc["process"]["args"] == ["sh", "-c", "changed"]
    assert doc["hooks"] == {"prestart": [USER_HOOK], "poststop": [USER_POSTSTOP]}
    assert open(path + ".gpuhook-bak").read() == original


def test_bundle_without_hooks_gets_them_and_loses_them_again(tmp_path):
    bundle = str(tmp_path / "b")
    original = '{"ociVersion": "1.0.2", "root": {"path": "rootfs"}}'
    write(f"{bundle}/config.json", original)
    apply_install("runc-bundle", bundle=bundle)
    hooks = json.loads(open(f"{bundle}/config.json").read())["hooks"]
    assert hooks == {"prestart": [gpuhook_entry("prestart")], "poststop": [gpuhook_entry("poststop")]}
    apply_uninstall("runc-bundle", bundle=bundle)
    assert snapshot(bundle) == {"config.json": original.encode()}


def test_bundle_registered_before_the_poststop_stage_gets_it_and_uninstall_restores_the_original(tmp_path):
    """A bundle an older gpuhook install changed (prestart only, with its backup): install adds
    the poststop entry without a new backup; uninstall restores the original bytes."""
    bundle, path, original = bundle_with_config(tmp_path)
    write(path + ".gpuhook-bak", original)
    doc = json.loads(original)
    doc["hooks"]["prestart"].append(gpuhook_entry("prestart"))
    write(path, json.dumps(doc, indent="\t") + "\n")
    assert apply_install("runc-bundle", bundle=bundle) == [f"updated {path}"]
    assert json.loads(open(path).read())["hooks"]["poststop"] == [USER_POSTSTOP, gpuhook_entry("poststop")]
    assert open(path + ".gpuhook-bak").read() == original
    apply_uninstall("runc-bundle", bundle=bundle)
    assert snapshot(bundle) == {"config.json": original.encode()}


def test_bundle_uninstall_takes_back_only_the_stages_gpuhook_registers(tmp_path):
    """A gpuhook entry someone wrote by hand for another stage is not install's to remove."""
    bundle = str(tmp_path / "b")
    by_hand = {"path": "/usr/bin/gpuhook", "args": ["gpuhook", "createRuntime"]}
    original = json.dumps({"root": {"path": "rootfs"}, "hooks": {"createRuntime": [by_hand]}})
    write(f"{bundle}/config.json", original)
    apply_install("runc-bundle", bundle=bundle)
    hooks = json.loads(open(f"{bundle}/config.json").read())["hooks"]
    assert hooks["createRuntime"] == [by_hand] and set(hooks) == {"createRuntime", "prestart", "poststop"}
    apply_uninstall("runc-bundle", bundle=bundle)
    assert snapshot(bundle) == {"config.json": original.encode()}
    assert install.without_hook(json.loads(open(f"{bundle}/config.json").read())) == json.loads(original)


@pytest.mark.parametrize("setup,args,message", [
    (None, [], "runc-bundle needs the bundle directory"),
    (None, ["{tmp}/nonexistent"], "is not a directory"),
    (lambda d: os.makedirs(d / "b"), ["{tmp}/b"], "has no config.json (create it with `runc spec`)"),
    (lambda d: write(d / "b" / "config.json", "{nope"), ["{tmp}/b"], "config.json: not valid JSON"),
    (lambda d: write(d / "b" / "config.json", "[]"), ["{tmp}/b"], "config.json: expected a JSON object"),
    (lambda d: write(d / "b" / "config.json", '{"hooks": []}'), ["{tmp}/b"], "'hooks' is not an object"),
    (lambda d: write(d / "b" / "config.json", '{"hooks": {"prestart": {}}}'), ["{tmp}/b"],
     "'hooks.prestart' is not a list"),
    (lambda d: write(d / "b" / "config.json", '{"hooks": {"prestart": [], "poststop": "x"}}'), ["{tmp}/b"],
     "'hooks.poststop' is not a list"),
])
def test_bad_bundles_are_one_line_errors_and_nothing_changes(tmp_path, setup, args, message):
    if setup is not None:
        setup(tmp_path)
    before = snapshot(tmp_path)
    done = gpuhook_cli("install", "runc-bundle", *[a.format(tmp=tmp_path) for a in args], check=False)
    one_line_error(done, message)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("args,message", [
    (["containerd", "--hooks-dir", "/x"], "--hooks-dir does not apply to containerd (only to podman, crio)"),
    (["podman", "/some/bundle"], "BUNDLE does not apply to podman (only to runc-bundle)"),
    (["runc-bundle", "/b", "--output", "/x"], "--output does not apply to runc-bundle (only to containerd)"),
    (["podman", "--annotated", "--base-spec", "/x"], "--base-spec does not apply to podman"),
    (["kubelet"], "Invalid value for 'TARGET'"),
    (["podman", "--bin-dir", "/x"], "--bin-dir does not apply to podman (only to docker)"),
])
def test_options_for_another_target_are_errors(args, message):
    one_line_error(gpuhook_cli("install", *args, check=False), message)


def test_a_write_failure_is_a_one_line_error_and_leaves_the_old_file(tmp_path):
    hooks_dir = tmp_path / "hooks.d"
    write(hooks_dir / "gpuhook.json", "{}")
    os.mkfifo(hooks_dir / "gpuhook-poststop.json")  # in the way of the second file
    done = gpuhook_cli("install", "podman", "--hooks-dir", str(hooks_dir), check=False)
    one_line_error(done, "gpuhook-poststop.json is not a regular file")
    assert (hooks_dir / "gpuhook.json").read_text() == "{}"


DEBIAN_CONFIG = """\
version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"
"""


# The shape `containerd config default` writes: the runc table with an empty base spec.
GENERATED_CONFIG = """\
version = 2
root = "/var/lib/containerd"

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.6"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes]
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
          base_runtime_spec = ""  # kept as is
          runtime_type = "io.containerd.runc.v2"
          [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
            SystemdCgroup = true
"""


HEADER_ONLY_CONFIG = """\
version = 2
[plugins.'io.containerd.grpc.v1.cri'.containerd.runtimes.runc]   # single quotes, a comment
  runtime_type = "io.containerd.runc.v2"
"""


COMMENTS_ONLY_CONFIG = "# containerd reads this file\n# (nothing set yet)\n"


BASE_SPEC = {"ociVersion": "1.0.2-dev", "process": {"cwd": "/"}, "root": {"path": "rootfs"},
             "linux": {"namespaces": [{"type": "pid"}]}}


def containerd_paths(tmp_path) -> dict:
    base = write(tmp_path / "base.json", json.dumps(BASE_SPEC, indent=4) + "\n")
    return {"spec_path": str(tmp_path / "etc" / "gpuhook-base-spec.json"),
            "containerd_config": str(tmp_path / "etc" / "config.toml"), "base_spec": base}


def test_a_containerd_config_of_another_path_is_not_told_to_restart_the_systems_containerd(tmp_path):
    """install containerd --containerd-config FILE said 'systemctl restart containerd', which
    restarts the system's daemon, not the one that reads FILE."""
    paths = containerd_paths(tmp_path)
    config = paths["containerd_config"]
    for notes in (install.plan_install("containerd", environ={}, **paths).notes,
                  (apply_install("containerd", **paths) and
                   install.plan_uninstall("containerd", spec_path=paths["spec_path"], containerd_config=config).notes)):
        assert not any("systemctl" in note for note in notes), notes
        assert any(note.startswith(f"restart the containerd that reads {config}") for note in notes), notes
    from gpuhook.install import containerd

    for installing in (True, False):
        notes = containerd._containerd_notes(install.CONTAINERD_CONFIG, installing)
        assert notes[0].startswith(f"restart containerd to load {install.CONTAINERD_CONFIG} "
                                   "(systemctl restart containerd)"), notes


@pytest.mark.parametrize("original,added_runtime_type", [
    (DEBIAN_CONFIG, True), (GENERATED_CONFIG, False), (HEADER_ONLY_CONFIG, False),
    (COMMENTS_ONLY_CONFIG, True), (None, True),
], ids=["debian", "config-default", "header-only", "comments-only", "missing"])
def test_containerd_config_gets_exactly_the_base_spec_setting_and_loses_it_again(
        tmp_path, original, added_runtime_type):
    paths = containerd_paths(tmp_path)
    config = paths["containerd_config"]
    if original is not None:
        write(config, original)
    apply_install("containerd", **paths)
    text = open(config).read()
    new = tomllib.loads(text)
    expected = tomllib.loads(original or "")
    runc = expected
    for key in CRI_RUNC:
        runc = runc.setdefault(key, {})
    runc["base_runtime_spec"] = paths["spec_path"]
    if added_runtime_type:
        runc["runtime_type"] = "io.containerd.runc.v2"
    expected.setdefault("version", 2)
    assert new == expected
    for line in (original or "").splitlines():
        if "base_runtime_spec" not in line:
            assert line + "\n" in text  # the user's lines and comments stay as they were
    assert json.loads(open(paths["spec_path"]).read()) == {
        **BASE_SPEC, "hooks": {"prestart": [gpuhook_entry("prestart")], "poststop": [gpuhook_entry("poststop")]}}
    assert os.path.exists(config + ".gpuhook-bak") == (original is not None)

    before = snapshot(tmp_path)
    assert all(line.startswith("unchanged") for line in apply_install("containerd", **paths))
    assert snapshot(tmp_path) == before

    apply_uninstall("containerd", spec_path=paths["spec_path"], containerd_config=config)
    expected_files = {"base.json"} | ({"etc/config.toml"} if original is not None else set())
    assert set(snapshot(tmp_path)) == expected_files
    if original is not None:
        assert open(config).read() == original


def test_containerd_changed_line_keeps_the_original_after_the_mark(tmp_path):
    paths = containerd_paths(tmp_path)
    write(paths["containerd_config"], GENERATED_CONFIG)
    apply_install("containerd", **paths)
    (line,) = [x for x in open(paths["containerd_config"]) if "base_runtime_spec" in x]
    assert line == (f'          base_runtime_spec = "{paths["spec_path"]}"  '
                    '# changed by gpuhook install, was: base_runtime_spec = ""  # kept as is\n')


def test_containerd_default_spec_comes_from_ctr(tmp_path):
    require(shutil.which("ctr") is not None, "needs ctr (containerd)")
    paths = containerd_paths(tmp_path)
    del paths["base_spec"]
    apply_install("containerd", **paths)
    spec = json.loads(open(paths["spec_path"]).read())
    default = json.loads(subprocess.run(["ctr", "oci", "spec"], capture_output=True, check=True).stdout)
    del default["process"]["rlimits"]  # CRI drops it without a base spec, and keeps a base spec's
    assert install.without_hook(spec) == default
    assert install.has_gpuhook(spec)


def test_containerd_refuses_to_replace_another_base_spec_but_adds_to_it(tmp_path):
    paths = containerd_paths(tmp_path)
    theirs = write(tmp_path / "etc" / "their-spec.json", json.dumps(BASE_SPEC) + "\n")
    config = write(paths["containerd_config"], DEBIAN_CONFIG.replace(
        "  [plugins.\"io.containerd.internal.v1.opt\"]",
        f"    [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n"
        f"      base_runtime_spec = \"{theirs}\"\n  [plugins.\"io.containerd.internal.v1.opt\"]"))
    config_text = open(config).read()
    done = gpuhook_cli("install", "containerd", "--output", paths["spec_path"], "--containerd-config", config,
                       check=False)
    one_line_error(done, f'already uses base_runtime_spec = "{theirs}"', f"--output {theirs}")

    apply_install("containerd", spec_path=theirs, containerd_config=config)
    assert open(config).read() == config_text
    assert install.has_gpuhook(json.loads(open(theirs).read()))
    assert open(theirs + ".gpuhook-bak").read() == json.dumps(BASE_SPEC) + "\n"
    apply_uninstall("containerd", spec_path=theirs, containerd_config=config)
    assert open(theirs).read() == json.dumps(BASE_SPEC) + "\n" and not os.path.exists(theirs + ".gpuhook-bak")


V3_CONFIG = """version = 3
# containerd 2.x: CRI's runtimes are in the runtime plugin
[plugins."io.containerd.cri.v1.runtime".containerd]
  default_runtime_name = "runc"
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
    SystemdCgroup = false
"""


# What `containerd config default` of 2.3 prints (config version 4: server settings in plugins).
V4_CONFIG = """version = 4
root = '/var/lib/containerd'
state = '/run/containerd'

[plugins]
  [plugins.'io.containerd.cri.v1.runtime']
    enable_cdi = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes]
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
          runtime_type = 'io.containerd.runc.v2'
          [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
            SystemdCgroup = false
  [plugins.'io.containerd.server.v1.grpc']
    address = '/run/containerd/containerd.sock'
"""


@pytest.mark.parametrize("text", [V3_CONFIG, "version = 3\n", V4_CONFIG, "version = 4\n"],
                         ids=["v3", "v3-empty", "v4", "v4-empty"])
def test_containerd_2_config_versions_3_and_4_are_edited_in_the_runtime_plugin_and_restored_exactly(tmp_path, text):
    """containerd 2.x reads config versions 3 and 4 (2.3's default), where CRI's runc runtime
    is under io.containerd.cri.v1.runtime. gpuhook refused version 4 with hand instructions
    for the version-2 table, which containerd 2.x ignores."""
    import tomllib

    paths = containerd_paths(tmp_path)
    write(paths["containerd_config"], text)
    done = gpuhook_cli("install", "containerd", "--output", paths["spec_path"], "--containerd-config",
                       paths["containerd_config"], "--base-spec", paths["base_spec"])
    version = tomllib.loads(text)["version"]
    assert f'[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc] (config version {version})' \
        in done.stdout
    doc = tomllib.loads(open(paths["containerd_config"]).read())
    runc = doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["runc"]
    assert runc["base_runtime_spec"] == paths["spec_path"] and runc["runtime_type"] == "io.containerd.runc.v2"
    assert "io.containerd.grpc.v1.cri" not in doc["plugins"] and doc["version"] == version
    if text in (V3_CONFIG, V4_CONFIG):
        assert runc["options"] == {"SystemdCgroup": False}
    apply_uninstall("containerd", spec_path=paths["spec_path"], containerd_config=paths["containerd_config"])
    assert open(paths["containerd_config"]).read() == text


def test_a_containerd_2_config_never_takes_the_default_spec_of_an_installed_containerd_1(tmp_path):
    """Found with a real containerd 2.3.4 built for a one-off check: with it stopped, install
    took Debian's ctr 1.6 spec for a version-4 config (ociVersion 1.0.2-dev, no powercap mask)."""
    require(shutil.which("containerd") is not None, "needs containerd")
    release = subprocess.run(["containerd", "--version"], capture_output=True, text=True).stdout.split()[2]
    require(release.lstrip("v").startswith("1."), "needs an installed containerd 1.x (Debian's)")
    paths = containerd_paths(tmp_path)
    write(paths["containerd_config"], f"version = 3\n[grpc]\n  address = '{tmp_path}/none.sock'\n")
    before = snapshot(tmp_path)
    done = gpuhook_cli("install", "containerd", "--output", paths["spec_path"], "--containerd-config",
                       paths["containerd_config"], check=False)
    one_line_error(done, f"the config is version 3 (containerd 2), but no containerd serves {tmp_path}/none.sock",
                   "--base-spec FILE")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("text,message,hint", [
    ("version = 5\n", "containerd config version 5: gpuhook edits versions 1, 2, 3, 4",
     "by hand to CRI's runc runtime table of config version 5"),
    ('version = "3"\n', "containerd config version 3: gpuhook edits versions", "`version` must be a number"),
    ("version = 2\n[plugins\n", "invalid TOML", ""),
    ('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\nruntimes.runc.runtime_type = "x"\n',
     "cannot add base_runtime_spec safely",
     '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc] (config version 2)'),
    ('version = 4\n[plugins."io.containerd.cri.v1.runtime".containerd]\nruntimes.runc.runtime_type = "x"\n',
     "cannot add base_runtime_spec safely",
     '[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc] (config version 4)'),
    ('[plugins.cri.containerd]\nruntimes.runc.runtime_type = "x"\n', "cannot add base_runtime_spec safely",
     "[plugins.cri.containerd.runtimes.runc] (config version 1)"),
], ids=["v5", "v-string", "bad-toml", "v2-dotted", "v4-dotted", "v1-dotted"])
def test_containerd_configs_gpuhook_cannot_edit_are_errors_that_name_the_table_of_their_version(
        tmp_path, text, message, hint):
    paths = containerd_paths(tmp_path)
    write(paths["containerd_config"], text)
    before = snapshot(tmp_path)
    done = gpuhook_cli("install", "containerd", "--output", paths["spec_path"], "--containerd-config",
                       paths["containerd_config"], "--base-spec", paths["base_spec"], check=False)
    one_line_error(done, message, hint)
    assert snapshot(tmp_path) == before


def scenario_podman(tmp_path):
    write(tmp_path / "hooks.d" / "gpuhook.json", '{"hook": {"path": "/usr/local/bin/theirs"}}\n')
    return ["podman", "--hooks-dir", str(tmp_path / "hooks.d")]


def scenario_bundle(tmp_path):
    bundle_with_config(tmp_path)
    return ["runc-bundle", str(tmp_path / "bundle")]


def scenario_containerd(tmp_path):
    paths = containerd_paths(tmp_path)
    write(paths["containerd_config"], GENERATED_CONFIG)
    return ["containerd", "--output", paths["spec_path"], "--containerd-config", paths["containerd_config"]]


def apply_with_patch(diff: str, real: str, copy: str) -> None:
    """Apply a dry run's diff, written for files under `real`, to the same files under `copy`."""
    diff = diff.replace(f"--- {real}/", "--- a/").replace(f"+++ {real}/", "+++ b/")
    subprocess.run(["patch", "--silent", "-p1", "-d", copy], input=diff, text=True, check=True)


@pytest.mark.parametrize("scenario", [scenario_podman, scenario_bundle, scenario_containerd])
def test_a_dry_run_diff_patched_in_gives_what_install_and_uninstall_do(tmp_path, scenario):
    require(shutil.which("patch") is not None, "needs patch")
    real, copy = tmp_path / "real", tmp_path / "copy"
    real.mkdir()
    args = scenario(real)
    base_spec = ["--base-spec", str(real / "base.json")] if args[0] == "containerd" else []
    not_backups = lambda files: {k: v for k, v in files.items() if not k.endswith(".gpuhook-bak")}  # noqa: E731
    for command, extra in (("install", base_spec), ("uninstall", [])):
        shutil.copytree(real, copy)
        before = snapshot(real)
        dry = gpuhook_cli(command, *args, *extra, "--dry-run").stdout
        assert snapshot(real) == before
        gpuhook_cli(command, *args, *extra)
        apply_with_patch(dry, str(real), str(copy))
        assert not_backups(snapshot(copy)) == not_backups(snapshot(real))
        shutil.rmtree(copy)


# --- the native front (native/prescan.c) in the registrations ---------------------------


@pytest.fixture(scope="module")
def built_front(tmp_path_factory):
    """native/build.py's front, as `gpuhook install --front` is given it."""
    require(shutil.which("gcc") is not None, "needs gcc")
    out = tmp_path_factory.mktemp("front")
    done = subprocess.run([sys.executable, os.path.join(REPO, "native", "build.py"), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def front_document(front, stage, config) -> dict:
    doc = expected_hooks_d_document(stage, config)
    doc["hook"]["path"] = front
    doc["hook"]["args"] = [front, *doc["hook"]["args"]]
    return doc


def test_install_with_front_registers_it_in_front_of_the_python_command(tmp_path, built_front):
    config = sim_config(tmp_path)
    apply_install("podman", hooks_dir=str(tmp_path / "hooks.d"), config_path=config, front=built_front)
    for stage, name in HOOK_FILES.items():
        assert json.loads((tmp_path / "hooks.d" / name).read_text()) == front_document(built_front, stage, config)
    # ... and the same registration is recognised as gpuhook's: uninstall takes it back.
    apply_uninstall("podman", hooks_dir=str(tmp_path / "hooks.d"))
    assert os.listdir(tmp_path / "hooks.d") == []


def test_containerd_bundle_and_docker_registrations_use_the_front_too(tmp_path, built_front):
    config = sim_config(tmp_path)
    hook = install.this_installation(config_path=config, environ={}, front=built_front)
    for entry in hook.entries().values():
        assert entry["path"] == built_front and entry["args"][:2] == [built_front, sys.executable]
        assert install.is_gpuhook_entry(entry)
    bundle = tmp_path / "bundle"
    write(bundle / "config.json", json.dumps({"ociVersion": "1.0.2"}))
    apply_install("runc-bundle", bundle=str(bundle), config_path=config, front=built_front)
    spec = json.loads((bundle / "config.json").read_text())
    assert [e["path"] for s in ("prestart", "poststop") for e in spec["hooks"][s]] == [built_front] * 2
    assert install.has_gpuhook(spec) and not install.has_gpuhook(install.without_hook(spec))
    launcher = install.launcher_text(hook)
    assert f"'{built_front}' '{sys.executable}' -I -S '{LAUNCHER}' \"$1\"" in launcher


def test_a_front_of_another_protocol_or_not_a_front_is_refused(tmp_path, built_front):
    wrong = tmp_path / "wrong-front"
    wrong.write_text("#!/bin/sh\necho 999\n")
    wrong.chmod(0o755)
    for path in (str(wrong), str(tmp_path / "absent"), "/bin/true"):
        with pytest.raises(install.InstallError, match="not a gpuhook front"):
            install.plan_install("podman", hooks_dir=str(tmp_path / "hooks.d"), environ={}, front=path)
    with pytest.raises(install.InstallError, match="contradict"):
        install.plan_install("podman", hooks_dir=str(tmp_path / "hooks.d"), environ={}, front=built_front,
                             no_front=True)


def test_without_a_front_a_development_install_registers_the_python_command(tmp_path, monkeypatch, built_front):
    # A gpuhook outside /usr/lib (this tree) never picks the packaged front, even when present.
    monkeypatch.setattr(install.common, "PACKAGED_FRONT", built_front)
    assert install.pick_front(None) is None
    assert install.this_installation(environ={}).entry()["path"] == sys.executable
    assert install.pick_front(None, no_front=True) is None


def test_a_packaged_gpuhook_picks_the_packaged_front_only_when_it_checks_out(tmp_path, monkeypatch, built_front):
    monkeypatch.setattr(install.common, "launcher_path", lambda: install.DEBIAN_LAUNCHER)
    monkeypatch.setattr(install.common, "PACKAGED_FRONT", built_front)
    assert install.pick_front(None) == built_front
    assert install.pick_front(None, no_front=True) is None
    wrong = tmp_path / "old-front"
    wrong.write_text("#!/bin/sh\necho 0\n")
    wrong.chmod(0o755)
    monkeypatch.setattr(install.common, "PACKAGED_FRONT", str(wrong))
    assert install.pick_front(None) is None  # another protocol: the Python command, as before
    monkeypatch.setattr(install.common, "PACKAGED_FRONT", str(tmp_path / "absent"))
    assert install.pick_front(None) is None


def test_the_cli_takes_front_and_no_front(tmp_path, built_front):
    config = sim_config(tmp_path)
    done = gpuhook_cli("install", "podman", "--hooks-dir", str(tmp_path / "h"), "--config", config,
                       "--front", built_front, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert f'"path": "{built_front}"' in done.stdout
    done = gpuhook_cli("install", "podman", "--hooks-dir", str(tmp_path / "h"), "--config", config, "--no-front",
                       "--dry-run")
    assert done.returncode == 0 and built_front not in done.stdout
