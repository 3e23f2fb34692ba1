"""The decision log an operator keeps (docs/logging.md): bounded lines, tagged, with the pod UID.

The tests of it that need no root; those that do are in tests/integration/test_logging.py.
"""

import json
from gpuhook import journal


K8S = {"io.kubernetes.pod.name": "trainer-0", "io.kubernetes.pod.namespace": "ml",
       "io.kubernetes.container.name": "main", "io.kubernetes.pod.uid": "6f1c0d7e-uid"}


def test_a_line_is_bounded_whatever_the_record_holds():
    record = {"stage": "prestart", "container": "c1", "decision": "gpus injected", "pod": "p" * (1 << 20),
              "gpus": [f"GPU-{i:08d}-0000-0000-0000-000000000000" for i in range(16)],
              "health": {"gpus": [{"uuid": f"GPU-{i}", "detail": "x" * 4000} for i in range(16)]}}
    data = journal.line_bytes(record)
    assert len(data) <= journal.MAX_LINE_BYTES and data.endswith(b"\n")
    doc = json.loads(data)
    assert doc["decision"] == "gpus injected" and doc["container"] == "c1"
    assert "truncated" in doc or doc["pod"].endswith("chars)")
    assert len(journal.line_bytes({"stage": "prestart", "notes": ["n"] * 100})) <= journal.MAX_LINE_BYTES


def test_k8s_names_include_the_pod_uid_from_either_runtime():
    assert journal.k8s_names(K8S)["pod_uid"] == "6f1c0d7e-uid"
    assert journal.k8s_names({"io.kubernetes.cri.sandbox-uid": "u2"}) == {"pod_uid": "u2"}
