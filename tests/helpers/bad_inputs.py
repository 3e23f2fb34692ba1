"""The corpus of malformed and hostile inputs fed to the hook exactly as a runtime would:
tests/integration/test_bad_input.py runs every case against a simulated host (one line on
stderr, the documented exit code, no host change); tests/unit/test_bad_input_corpus.py checks
the corpus itself."""

GPU_ENV = ["NVIDIA_VISIBLE_DEVICES=0"]


class Case:
    def __init__(self, name, code, message, state=None, spec=None, env=None, config=None, raw_state=None,
                 raw_spec=None, setup=None):
        self.name, self.code, self.message = name, code, message
        self.state, self.spec, self.env = state or {}, spec, env
        self.config, self.raw_state, self.raw_spec, self.setup = config, raw_state, raw_spec, setup

    def __repr__(self):
        return self.name


def S(**fields):
    """State fields over a valid default (use ... to delete a field)."""
    return fields


BIG_IDS = ",".join(f"GPU-{i:08d}" for i in range(20000))


CASES = [
    # --- the state document on stdin
    Case("empty stdin", 2, "state is empty", raw_state=b""),
    Case("whitespace only", 2, "state is empty", raw_state=b" \n\t "),
    Case("truncated object", 2, "not valid JSON", raw_state=b'{"id":"x","bundle":"/b"'),
    Case("not json", 2, "not valid JSON", raw_state=b"hello"),
    Case("json array", 2, "must be a JSON object, not list", raw_state=b"[]"),
    Case("json string", 2, "must be a JSON object, not str", raw_state=b'"x"'),
    Case("json number", 2, "must be a JSON object, not int", raw_state=b"42"),
    Case("json null", 2, "must be a JSON object, not NoneType", raw_state=b"null"),
    Case("utf-8 bom", 2, "not valid JSON", raw_state=b'\xef\xbb\xbf{"id":"x"}'),
    Case("invalid utf-8", 2, "not UTF-8", raw_state=b'{"id":"\xff"}'),
    Case("raw NUL byte in the bundle", 2, "not valid JSON",
         raw_state=b'{"id":"x","status":"creating","pid":1,"bundle":"/tmp\x00/x"}'),
    Case("raw control byte in the bundle", 2, "not valid JSON",
         raw_state=b'{"id":"x","status":"creating","pid":1,"bundle":"/tmp\n/x"}'),
    Case("huge state", 2, "larger than", raw_state=b'{"id":"' + b"x" * (5 << 20) + b'"}'),
    Case("deep nesting", 2, "nested too deeply", raw_state=b'{"a":' * 50000 + b"1" + b"}" * 50000),
    Case("id missing", 2, "missing 'id'", state=S(id=...)),
    Case("id is a number", 2, "'id' must be a string, not int", state=S(id=12)),
    Case("id empty", 2, "'id' is empty", state=S(id="")),
    Case("bundle missing", 2, "missing 'bundle'", state=S(bundle=...)),
    Case("bundle relative", 2, "must be an absolute path", state=S(bundle="bundles/x")),
    Case("bundle is a number", 2, "'bundle' must be a string", state=S(bundle=7)),
    Case("bundle with NUL", 2, "NUL byte", state=S(bundle="/tmp/a\u0000b")),
    Case("bundle does not exist", 2, "has no config.json", state=S(bundle="/nonexistent/bundle")),
    Case("bundle is a file", 2, "not a directory", state=S(bundle="/etc/hostname")),
    Case("pid is a string", 2, "'pid' must be a whole number", state=S(pid="12")),
    Case("pid is a float", 2, "'pid' must be a whole number", state=S(pid=1.5)),
    Case("pid is negative", 2, "out of range", state=S(pid=-5)),
    Case("pid is huge", 2, "out of range", state=S(pid=10 ** 12)),
    Case("pid is a bool", 2, "'pid' must be a whole number", state=S(pid=True)),
    Case("pid zero with a request", 2, "no container pid", state=S(pid=0)),
    Case("pid missing with a request", 2, "no container pid", state=S(pid=...)),
    Case("pid of a dead process", 4, "is gone", state=S(pid="DEAD")),
    Case("pid not a container", 4, "shares the hook's mount namespace", state=S(pid="SELF")),
    Case("status running", 2, "status 'running'", state=S(status="running")),
    Case("status stopped", 2, "status 'stopped'", state=S(status="stopped")),
    Case("status is a list", 2, "'status' must be a string", state=S(status=["creating"])),
    Case("annotations is a list", 2, "'annotations' must be an object", state=S(annotations=["a"])),
    Case("annotation value not a string", 2, "value of 'k' must be a string", state=S(annotations={"k": 1})),
    Case("unknown fields are accepted", 4, "is gone", state=S(pid="DEAD", extra={"x": [1, 2]}, root="rootfs")),
    # --- the bundle's config.json
    # (A config.json the pre-scan finds no request marker in is left alone: the runtime has
    # parsed it already, and validating it would cost every GPU-less container a json import.
    # With a marker, the full parser runs and reports.)
    Case("config.json invalid", 2, "config.json is not valid JSON",
         raw_spec=b"{'env': ['NVIDIA_VISIBLE_DEVICES=0']}"),
    Case("config.json truncated", 2, "config.json is not valid JSON",
         raw_spec=b'{"root":{"path":"rootfs"},"process":{"env":["NVIDIA_VISIBLE_DEVICES=0"'),
    Case("config.json array", 2, "config.json must be a JSON object", raw_spec=b'["NVIDIA_VISIBLE_DEVICES=0"]'),
    Case("config.json not utf-8", 2, "config.json is not UTF-8", raw_spec=b'{"a":"\xfe NVIDIA_VISIBLE_DEVICES=0"}'),
    Case("root missing", 2, "missing 'root'", spec={"process": {"env": GPU_ENV}}),
    Case("root.path empty", 2, "root.path is empty", spec={"root": {"path": ""}, "process": {"env": GPU_ENV}}),
    Case("root.path is the host root", 2, "resolves to the host's /",
         spec={"root": {"path": "../../../../../../.."}, "process": {"env": GPU_ENV}}),
    Case("process.env is a string", 2, "process.env must be a list",
         spec={"root": {"path": "rootfs"}, "process": {"env": "NVIDIA_VISIBLE_DEVICES=0"}}),
    Case("env entry is a number", 2, "entries must be strings",
         spec={"root": {"path": "rootfs"}, "process": {"env": GPU_ENV + [5]}}),
    Case("mounts is an object", 2, "'mounts' must be a list",
         spec={"root": {"path": "rootfs"}, "process": {"env": GPU_ENV}, "mounts": {"a": 1}}),
    Case("mount without destination", 2, "missing 'destination'",
         spec={"root": {"path": "rootfs"}, "process": {"env": GPU_ENV}, "mounts": [{"source": "/dev/null"}]}),
    Case("bounding caps wrong type", 2, "bounding must be a list of strings",
         spec={"root": {"path": "rootfs"}, "process": {"env": GPU_ENV, "capabilities": {"bounding": [1]}}}),
    Case("config.json is a directory", 2, "is not a regular file", setup="config-dir"),
    Case("config.json is a FIFO", 2, "is not a regular file", setup="config-fifo"),
    Case("root and Root: runc takes the last, case-insensitively", 2, "appears twice",
         raw_spec=b'{"root":{"path":"rootfs"},"Root":{"path":"/tmp"},"process":{"env":["NVIDIA_VISIBLE_DEVICES=0"]}}'),
    Case("duplicate pid in the state", 2, "appears twice",
         raw_state=b'{"id":"x","status":"creating","pid":1,"PID":2,"bundle":"/tmp"}'),
    Case("a lone Linux: runc reads it as linux, crun ignores it", 2, "is not runtime-spec's 'linux'",
         raw_spec=b'{"root":{"path":"rootfs"},"process":{"env":["NVIDIA_VISIBLE_DEVICES=0"]},'
                  b'"Linux":{"devices":[{"path":"/dev/nvidia1","type":"c","major":195,"minor":1}]}}'),
    Case("access spelled with a long s, which Go folds to s", 2, "is not runtime-spec's 'access'",
         raw_spec='{"root":{"path":"rootfs"},"process":{"env":["NVIDIA_VISIBLE_DEVICES=0"]},"linux":{"resources":'
                  '{"devices":[{"allow":true,"type":"c","major":195,"minor":1,"acce\u017f\u017f":"rwm"}]}}}'.encode()),
    Case("a lone Pid in the state", 2, "is not runtime-spec's 'pid'",
         raw_state=b'{"id":"x","status":"creating","Pid":1,"bundle":"/tmp"}'),
    Case("rootfs missing", 2, "container rootfs", spec={"root": {"path": "no-such-rootfs"}, "process": {"env": GPU_ENV}}),
    # --- request values
    Case("unknown gpu id", 3, "requested GPU 'garbage'", env=["NVIDIA_VISIBLE_DEVICES=garbage"]),
    Case("fullwidth digit", 3, "does not exist", env=["NVIDIA_VISIBLE_DEVICES=\uff10"]),
    Case("index out of range", 3, "requested GPU '99'", env=["NVIDIA_VISIBLE_DEVICES=0,99"]),
    Case("none combined", 3, "'none' cannot be combined", env=["NVIDIA_VISIBLE_DEVICES=none,0"]),
    Case("unknown capability", 3, "unknown driver capability 'bogus'",
         env=["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,bogus"]),
    Case("newline in the device list", 3, "does not exist", env=["NVIDIA_VISIBLE_DEVICES=0\n1"]),
    Case("NUL in the device list", 3, "does not exist", env=["NVIDIA_VISIBLE_DEVICES=0\u00001"]),
    Case("enormous list of unknown ids", 3, "more than 1024 devices", env=[f"NVIDIA_VISIBLE_DEVICES={BIG_IDS}"]),
    Case("enormous list of duplicates", 4, "is gone", env=["NVIDIA_VISIBLE_DEVICES=" + ",".join(["1"] * 50000)],
         state=S(pid="DEAD")),
    Case("empty CDI device name", 3, "empty device name", env=[],
         state=S(annotations={"cdi.k8s.io/x": "nvidia.com/gpu="})),
    Case("200k distinct ids", 3, "more than 1024 devices",
         env=["NVIDIA_VISIBLE_DEVICES=" + ",".join(f"GPU-{i}" for i in range(200_000))]),
    Case("50k CDI names", 3, "more than 1024 devices", env=[],
         state=S(annotations={"cdi.k8s.io/x": ",".join(f"nvidia.com/gpu={i}" for i in range(50_000))})),
    Case("an index of 5000 digits", 3, "longer than 256", env=["NVIDIA_VISIBLE_DEVICES=" + "7" * 5000]),
    Case("an index of 250 digits", 3, "does not exist", env=["NVIDIA_VISIBLE_DEVICES=" + "7" * 250]),
    Case("a requirement of 5000 digits", 3, "is not a version",
         env=GPU_ENV + ["NVIDIA_REQUIRE_CUDA=cuda>=" + "1" * 5000]),
    Case("unicode everywhere", 3, "does not exist", env=["NVIDIA_VISIBLE_DEVICES=GPU-\u00e9\u4e2d\U0001f600"]),
    # --- gpuhook's own configuration
    Case("config.toml broken", 2, "invalid TOML", config="driver-root = [\n"),
    Case("config.toml unknown key", 2, "unknown key 'drvier-root'", config='drvier-root = "/"\n'),
    Case("config.toml wrong type", 2, "must be true or false", config="accept-volume-mounts = 1\n"),
    Case("config.toml relative path", 2, "must be an absolute path", config='proc-root = "proc"\n'),
    Case("config.toml missing", 2, "does not exist", config="MISSING"),
    Case("config.toml not utf-8", 2, "not UTF-8", config=b'proc-root = "\xff"\n'),
    Case("proc-root without a driver", 4, "no NVIDIA driver", config='proc-root = "/nonexistent"\n'),
    Case("driver-root without an ld cache", 4, "no ld cache", config="DRIVERLESS"),
]
