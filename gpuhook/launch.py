# The file the runtime executes: `python3 -I -S <site>/gpuhook/launch.py prestart`.
# -I ignores PYTHON* variables and the user site; -S skips site.py (milliseconds on every
# container start). Neither adds the package's parent to sys.path, so this file does, from
# its own absolute path. Kept tiny: a script is compiled on every run, modules are not.
import gc
import sys

# A hook lives for milliseconds: collection passes during its imports only cost time.
gc.disable()
sys.path.insert(0, __file__.rpartition("/")[0].rpartition("/")[0])
from gpuhook.entry import main  # noqa: E402

try:
    main()
    code = 0
except SystemExit as stop:
    code = stop.code
except BaseException as err:  # a bug outside the hook's own boundary: still one line, exit 70
    text = f"{type(err).__name__}: {err}".splitlines()[0] if str(err) else type(err).__name__
    print(f"gpuhook: internal error: {text}", file=sys.stderr)
    from gpuhook.errors import INTERNAL_ERROR

    code = INTERNAL_ERROR
if code is None:
    code = 0
elif not isinstance(code, int):
    print(code, file=sys.stderr)
    code = 1
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except (OSError, ValueError):
        pass
# Exit without interpreter teardown (4-7 ms per container start, measured by benchmarks/):
# everything the hook writes is written synchronously and its children are already reaped,
# and a worker thread stuck in a hung NVML call must not keep the runtime waiting.
import posix  # noqa: E402  (built in and already loaded: costs nothing)

posix._exit(code & 0xFF)
