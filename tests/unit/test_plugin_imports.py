"""`gpuhook plugin` against a fake kubelet that speaks the real v1beta1 gRPC API (the.

The tests of it that need no root; those that do are in tests/integration/test_plugin.py.
"""

import json
import subprocess
import sys
from conftest import REPO


def test_the_hook_never_imports_grpc():
    code = ("import sys; import gpuhook.hook, gpuhook.apply.run, gpuhook.discover.survey, gpuhook.plan.make, gpuhook.health.hooks, "
            "gpuhook.health.engine, gpuhook.entry, gpuhook.prescan; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('grpc', 'gpuhook.plugin')))))")
    done = subprocess.run([sys.executable, "-I", "-c", "import json; " + code], capture_output=True, text=True,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
