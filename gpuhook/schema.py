"""Checking a state document against the OCI runtime-spec state schema (jsonschema lives here).

The hook itself parses leniently (gpuhook.request.oci) because real runtimes deviate from the spec;
this module is for people: ``--dry-run`` reports every deviation, so an operator can tell a
runtime's quirk from a broken input. It is never imported on the hook's path.
"""

import json
import os

SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "oci-state.json")


def load_schema() -> dict:
    with open(SCHEMA_PATH) as f:
        return json.load(f)


def state_deviations(raw: bytes) -> list[str] | None:
    """Human-readable schema violations of a state document (empty when it conforms); None
    when jsonschema is not installed (the RHEL 9 RPM goes without: AppStream has none)."""
    try:
        import jsonschema
    except ImportError:
        return None

    try:
        doc = json.loads(raw)
    except ValueError:
        return ["not JSON"]
    validator = jsonschema.Draft4Validator(load_schema())
    found = []
    for error in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
        where = "/".join(str(p) for p in error.absolute_path) or "(document)"
        found.append(f"{where}: {error.message}")
    return found
