"""The hook's no-GPU path: decide from raw bytes whether a container could want a GPU.

gpuhook is registered for every container on a host, so a container that requests no GPU
must cost close to nothing (README, Performance). This module answers "might this container ask for a
GPU?" without importing anything beyond what a ``python3 -I -S`` interpreter has already
loaded (not even ``os`` or ``json``); tests/integration/test_hot_path.py keeps it that way.

The answer is conservative in one direction only: ``False`` means "certainly no request",
``True`` means "let the full parser decide". Every request channel has a marker that a
request cannot be spelled without:

- the environment: ``NVIDIA_VISIBLE_DEVICES`` and, for legacy CUDA images, ``CUDA_VERSION``;
- the device plugin's volume mounts: ``nvidia-container-devices``;
- CDI annotations: ``cdi.k8s.io``.

JSON can spell any character as ``\\uXXXX``; a marker hidden that way must not slip past, so
an escape that decodes to a character used in a marker sends the input to the full parser.
"""

# Markers use only characters JSON never has to escape; keep them that way.
MARKERS = (b"NVIDIA_VISIBLE_DEVICES", b"CUDA_VERSION", b"nvidia-container-devices", b"cdi.k8s.io")
_MARKER_CHARS = frozenset(b"".join(MARKERS)) | frozenset(b"=")
_NO_REQUEST_VALUES = (b"", b"void")
_VISIBLE = b'"NVIDIA_VISIBLE_DEVICES='

# Bounds on what the hook reads at all; the full parser reports anything larger.
MAX_STATE_BYTES = 4 << 20
MAX_CONFIG_BYTES = 64 << 20
# The native front (native/prescan.c) runs this hook with FRONT_VARIABLE=FRONT_PROTOCOL in its
# environment; both come from here at build time. A front built from another gpuhook (an
# upgrade that left the old binary registered) is refused: entry.check_front.
FRONT_VARIABLE = "GPUHOOK_FRONT_PROTOCOL"
FRONT_PROTOCOL = 1
_S_IFMT, _S_IFREG = 0o170000, 0o100000


def read_regular_file(path: str, limit: int, flags: int = 0, with_stat: bool = False):
    """Up to `limit` bytes of the regular file at `path` (and its stat, `with_stat`). Opened
    non-blocking and checked before reading: a FIFO or a device there (a bundle path the
    runtime took from a user) must not block the hook until the runtime kills it. `flags`
    are added to the open (O_NOFOLLOW where a planted symlink must not be followed). Raises
    OSError (EINVAL for a file that is not regular). The no-GPU path's copy of
    gpuhook.kernel.files.read_regular_file, which everything past this path uses: importing
    it would load two more modules here (tests/unit/test_files.py holds the two to the same
    answers). Uses the built-in posix module: nothing is imported."""
    import posix

    fd = posix.open(path, posix.O_RDONLY | posix.O_NONBLOCK | posix.O_CLOEXEC | flags)
    st = posix.fstat(fd)
    if st.st_mode & _S_IFMT != _S_IFREG:
        posix.close(fd)
        raise OSError(22, "not a regular file", path)
    with open(fd, "rb") as f:
        data = f.read(limit)
    return (data, st) if with_stat else data


def top_level_strings(data: bytes) -> dict[bytes, bytes] | None:
    """Raw (still escaped) values of the string members of a JSON object's top level.

    Returns None when `data` is not a well-formed-looking object; the full parser then
    produces the precise error. Nested values are skipped, strings honour escapes.
    """
    n = len(data)
    i = 0
    depth = 0
    key = None
    expecting_key = False
    out: dict[bytes, bytes] = {}
    while i < n:
        c = data[i]
        if c == 34:  # a string: find its closing quote, skipping escaped ones
            j = i + 1
            while True:
                j = data.find(b'"', j)
                if j < 0:
                    return None
                k = j
                while data[k - 1] == 92:
                    k -= 1
                if (j - k) % 2 == 0:
                    break
                j += 1
            if depth == 1:
                if expecting_key:
                    key = data[i + 1 : j]
                    expecting_key = False
                elif key is not None:
                    out[key] = data[i + 1 : j]
                    key = None
            i = j + 1
            continue
        if c == 123 or c == 91:  # { [
            depth += 1
            if depth == 1:
                if c != 123:
                    return None
                expecting_key = True
            elif depth == 2:
                key = None
        elif c == 125 or c == 93:  # } ]
            depth -= 1
            if depth == 0:
                return out
            if depth < 0:
                return None
        elif c == 44 and depth == 1:  # ,
            expecting_key = True
            key = None
        i += 1
    return None


def bundle_of(state: bytes) -> str | None:
    """The state's bundle path, or None when only the full parser can tell."""
    members = top_level_strings(state)
    if not members:
        return None
    raw = members.get(b"bundle")
    if not raw or 92 in raw or raw[:1] != b"/" or min(raw) < 0x20:
        return None  # escapes and control bytes (invalid in JSON strings): the full parser decides
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _hides_marker(data: bytes) -> bool:
    """True if a \\uXXXX escape in `data` spells a character that markers are made of."""
    if b"\\" not in data:  # most documents have no escape at all: one fast scan
        return False
    i = data.find(b"\\u")
    while i >= 0:
        try:
            code = int(data[i + 2 : i + 6], 16)
        except ValueError:
            return True
        if code in _MARKER_CHARS:
            return True
        i = data.find(b"\\u", i + 2)
    return False


def may_request_gpu(*documents: bytes) -> bool:
    """False only when none of `documents` can carry a GPU request."""
    found_visible = False
    for data in documents:
        if _hides_marker(data):
            return True
        for marker in MARKERS[1:]:
            if marker in data:
                return True
        if MARKERS[0] in data:
            found_visible = True
    if not found_visible:
        return False
    # Only NVIDIA_VISIBLE_DEVICES appears: it is still no request when every occurrence is
    # an environment entry with an empty or "void" value (common in CUDA-based CPU images).
    for data in documents:
        count = data.count(MARKERS[0])
        if not count:
            continue
        start = data.find(_VISIBLE)
        seen = 0
        while start >= 0:
            value_start = start + len(_VISIBLE)
            end = data.find(b'"', value_start)
            if end < 0 or data[value_start:end] not in _NO_REQUEST_VALUES:
                return True
            seen += 1
            start = data.find(_VISIBLE, end)
        if seen != count:
            return True
    return False


def split_hook_args(argv: list[str]) -> tuple[str, str | None] | None:
    """(stage, config path) for the plain hook invocations the fast path serves, else None."""
    if not argv:
        return None
    stage = argv[0]
    config = None
    rest = argv[1:]
    while rest:
        arg = rest.pop(0)
        if arg == "--config" and rest:
            config = rest.pop(0)
        elif arg.startswith("--config="):
            config = arg[len("--config=") :]
        else:
            return None
    return stage, config


