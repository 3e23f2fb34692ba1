"""NVIDIA_REQUIRE_* checked against the host: whether the GPUs and driver a container gets meet
what its image requires (NVIDIA's semantics: gpuhook.request.requirements, which parses them).

Pure: the caller supplies the host's facts (`HostFacts`: CUDA and driver versions, per GPU
its compute capability and brand, from NVML through the inventory cache); a requirement that
does not hold raises RequirementError naming the variable, the alternative and the GPU.
"""

from gpuhook.errors import HostError, RequirementError
from gpuhook.record import record
from gpuhook.request.requirements import MAX_VERSION_PART, SYNTAX_HINT, VERSION_KEYS, Constraint, Requirement, collect

CUDA_HINT = "update the host's driver, or use an image built for an earlier CUDA version"
# An upper bound (driver<500, cuda<=12.2) fails on a host that is too new: updating the driver
# cannot help there, the hint says what can.
CUDA_UPPER_HINT = ("use an image built for the host's newer CUDA version, or run it on a host with an older "
                   "driver")
CUDA_EXACT_HINT = "run it on a host whose {key} matches, or use an image built for the host's {key}"


class HostFacts(record("HostFacts", "cuda_version driver_version gpus")):
    """The host's side of the comparison. `gpus` holds the GPUs the container gets
    (gpuhook.discover.types.Gpu; empty: none), each checked by its `arch` (the compute
    capability, "8.0") and `brand` ("tesla"), None when unknown (which satisfies the
    constraint), and named in messages by its `label`; versions are strings ("12.4",
    "550.54.15") or None when unknown."""

    __slots__ = ()

    def __new__(cls, cuda_version, driver_version, gpus=()):
        return super().__new__(cls, cuda_version, driver_version, tuple(gpus))


def evaluate(env, host: HostFacts) -> None:
    """Check every requirement in `env` against `host`; raise RequirementError naming the
    variable, the constraint that failed and what the host has, or the malformed constraint."""
    for requirement in collect(env):
        check(requirement, host)


def check(requirement: Requirement, host: HostFacts) -> None:
    """Check one parsed requirement against the host, for each of its GPUs (see the module
    docstring); raise RequirementError if it does not hold."""
    per_gpu = any(c.key in ("arch", "brand") for alternative in requirement.alternatives for c in alternative)
    # cuda and driver constraints read no GPU: one evaluation answers for every GPU.
    for gpu in (host.gpus if per_gpu else host.gpus[:1]) or (None,):
        failures = _failures(requirement, host, gpu)
        if failures:
            raise _unsatisfied(requirement, host, gpu, failures)


def _failures(requirement: Requirement, host: HostFacts, gpu) -> list:
    """[] if some alternative holds, else (alternative, failing constraint) per alternative."""
    failures = []
    for alternative in requirement.alternatives:
        for constraint in alternative:
            if not _holds(requirement, constraint, host, gpu):
                failures.append((alternative, constraint))
                break
        else:
            return []
    return failures


def _host_value(key: str, host: HostFacts, gpu):
    if key == "cuda":
        return host.cuda_version
    if key == "driver":
        return host.driver_version
    if gpu is None:
        return None
    return gpu.arch if key == "arch" else gpu.brand


def _holds(requirement: Requirement, constraint: Constraint, host: HostFacts, gpu) -> bool:
    if constraint.problem:
        raise _malformed(requirement, constraint, constraint.problem)
    have = _host_value(constraint.key, host, gpu)
    if have is None:
        return True
    if constraint.key not in VERSION_KEYS:
        if constraint.operator not in ("=", "!="):
            raise _malformed(requirement, constraint, f"brand compares only with = and !=, not {constraint.operator}")
        return (have.lower() == constraint.value.lower()) == (constraint.operator == "=")
    want = _version(constraint.value)
    if want is None:
        raise _malformed(requirement, constraint, f"{_short(constraint.value, 40)} is not a version (digits and dots)")
    mine = _version(have)
    if mine is None:
        raise HostError(f"{requirement.variable}: cannot check {constraint.text}: the host's {constraint.key} "
                        f"version {have!r} is not numeric")
    order = (mine > want) - (mine < want)
    return {"=": order == 0, "!=": order != 0, "<": order < 0, "<=": order <= 0,
            ">": order > 0, ">=": order >= 0}[constraint.operator]


def _version(text: str):
    """A version as a comparable tuple with trailing zeros dropped; None if not digits and dots
    (or a part is longer than any real version's: int() refuses over 4300 digits)."""
    if not text or not text[0].isdigit() or any(c not in "0123456789." for c in text):
        return None
    if any(len(p) > MAX_VERSION_PART for p in text.split(".")):
        return None
    parts = [int(p) for p in text.split(".") if p]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def compare_versions(a: str, b: str) -> int:
    """-1, 0 or 1 as version `a` is below, equal to or above `b` (NVIDIA's numeric rules)."""
    va, vb = _version(a), _version(b)
    if va is None or vb is None:
        raise ValueError(f"not a version: {a if va is None else b!r}")
    return (va > vb) - (va < vb)


def _describe_host(host: HostFacts, gpu) -> str:
    facts = [f"cuda {host.cuda_version or 'unknown'}", f"driver {host.driver_version or 'unknown'}"]
    if gpu is not None:
        facts.append(f"{gpu.label}: brand {gpu.brand or 'unknown'}, arch {gpu.arch or 'unknown'}")
    return ", ".join(facts)


def _short(text: str, limit: int = 80) -> str:
    """`text` quoted, cut to `limit` characters: a message is one line a person reads."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def _clip(text: str, limit: int = 120) -> str:
    """`text` as is, cut to `limit` characters: an image's constraint is echoed, not its size."""
    return text if len(text) <= limit else text[:limit] + "..."


def _malformed(requirement: Requirement, constraint: Constraint, problem: str) -> RequirementError:
    return RequirementError(
        f"{requirement.variable}: malformed constraint {_short(constraint.text)}: {problem[:160]}",
        SYNTAX_HINT,
        variable=requirement.variable, constraint=constraint.text)


def _unsatisfied(requirement: Requirement, host: HostFacts, gpu, failures: list) -> RequirementError:
    alternative, constraint = failures[0]
    have = _host_value(constraint.key, host, gpu)
    where = f" on {gpu.label}" if gpu is not None and constraint.key in ("arch", "brand") else ""
    message = f"{requirement.variable} is not satisfied: {_clip(constraint.text)} is false, the host has " \
              f"{constraint.key} {have}{where}"
    if len(alternative) > 1:
        message += f" (in {_clip(','.join(c.text for c in alternative), 240)})"
    others = len(failures) - 1
    if others:
        message += f"; none of the other {others} alternative{'s' if others > 1 else ''} holds either"
    host_text = _describe_host(host, gpu)
    message += f" [host: {host_text}]"
    hint = None
    if constraint.key in ("cuda", "driver"):
        hint = {"<": CUDA_UPPER_HINT, "<=": CUDA_UPPER_HINT, ">": CUDA_HINT, ">=": CUDA_HINT}.get(
            constraint.operator, CUDA_EXACT_HINT.format(key=constraint.key))
    return RequirementError(message, hint, variable=requirement.variable, constraint=constraint.text, host=host_text)
