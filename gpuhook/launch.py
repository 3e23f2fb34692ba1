# The file the runtime executes: `python3 -I -S <site>/gpuhook/launch.py prestart`.
# -I ignores PYTHON* variables and the user site; -S skips site.py (milliseconds on every
# container start). Neither adds the package's parent to sys.path, so this file does, from
# its own absolute path. Kept tiny: a script is compiled on every run, modules are not.
import sys

sys.path.insert(0, __file__.rpartition("/")[0].rpartition("/")[0])
from gpuhook.entry import main  # noqa: E402

main()
