"""Never more GPUs than the orchestrator granted (README, "Request channels"; docs/requests.md).

Every CUDA image sets NVIDIA_VISIBLE_DEVICES=all. A pod that the device plugin (or DRA, or
the runtime's own CDI) granted one GPU must get that GPU and nothing more: the grant wins
over the environment, a grant the policy refuses is not replaced by it, and a grant that
cannot be resolved fails. No root needed here; tests/integration/test_cdi_runc.py runs real containers.
"""

import json
import os
import pytest
from gpuhook.discover import cdi
from gpuhook.errors import RequestError
from conftest import require_root_tools


CLAIM_SPEC = {
    "cdiVersion": "0.6.0", "kind": "k8s.gpu.nvidia.com/claim",
    "devices": [{"name": "uid-gpu-0", "containerEdits": {"deviceNodes": [
        {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}]}}],
    "containerEdits": {"deviceNodes": [{"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255}]},
}


def write(directory, name, text, mode=0o644):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(text if isinstance(text, str) else json.dumps(text))
    os.chmod(path, mode)
    return path


def test_a_spec_others_can_write_is_not_trusted(tmp_path):
    require_root_tools()  # trust is root ownership; under CI a missing root fails, never skips
    write(tmp_path, "claim.json", CLAIM_SPEC, mode=0o666)
    with pytest.raises(RequestError, match="no CDI spec"):
        cdi.resolve(["k8s.gpu.nvidia.com/claim=uid-gpu-0"], [str(tmp_path)])
