"""NVIDIA_REQUIRE_* image requirements, with NVIDIA's semantics (docs/runtime-facts.md §3).

CUDA images state what they need from the host driver, e.g. a CUDA 12.2 image::

    NVIDIA_REQUIRE_CUDA="cuda>=12.2 brand=tesla,driver>=470,driver<471 brand=unknown,..."

The rules, learnt from NVIDIA's implementations (libnvidia-container's src/cli/dsl.c and
configure.c, which nvidia-container-cli applies; the container toolkit's
internal/config/image/cuda_image.go, which collects the variables):

- Every variable named NVIDIA_REQUIRE_* except NVIDIA_REQUIRE_JETPACK* is a requirement; all
  must hold (AND). Empty ones are ignored. NVIDIA_DISABLE_REQUIRE set to a true value
  (1, t, T, true, TRUE, True) skips them all.
- A legacy image (CUDA_VERSION set, NVIDIA_REQUIRE_CUDA unset or empty) requires
  cuda>=MAJOR.MINOR of its CUDA_VERSION.
- Within one requirement, space-separated alternatives are OR'ed; the comma-separated
  constraints of an alternative are AND'ed. Evaluation is left to right and stops at the
  first alternative that holds (and, inside one, at the first constraint that fails), so a
  malformed constraint after a satisfied alternative is never looked at, as in NVIDIA's.
- A constraint is KEY OP VALUE. Keys (case-insensitive): cuda (the CUDA version the driver
  supports, "12.4"), driver (the driver version, "550.54.15"), arch (the GPU's compute
  capability, "9.0"), brand (the GPU's brand, "tesla"). Operators: = != < <= > >=
  (NVIDIA has no "=="; it is a malformed constraint there and here).
- cuda, driver and arch compare as versions: digits and dots only, numerically component by
  component, missing trailing components count as 0 (12.2 = 12.2.0). brand compares as text,
  case-insensitively, with = and != only.
- arch and brand are per GPU: every requirement must hold for every GPU the container gets.
  A container given no GPU satisfies arch and brand constraints, and a fact the host could
  not provide (None) satisfies its constraints too; NVIDIA does both.

This module parses and bounds them (a start decides from them whether NVML is needed);
gpuhook.plan.requirements checks them against the host's facts. Pure and standard-library
only.

Bounded: NVIDIA's tools read requirements of any size, but a CUDA image's is a few hundred
bytes with some forty alternatives, and the image controls it. A variable over
MAX_REQUIREMENT_BYTES, with more than MAX_ALTERNATIVES alternatives, or more than
MAX_REQUIREMENTS variables, is refused (RequirementError) before anything is parsed, so
checking them costs a bounded time whatever the environment holds (docs/security.md).
"""

from gpuhook.errors import RequirementError
from gpuhook.record import record

PREFIX = "NVIDIA_REQUIRE_"
EXCLUDED_PREFIX = "NVIDIA_REQUIRE_JETPACK"  # Jetson host-mount lists, not constraints
DISABLE = "NVIDIA_DISABLE_REQUIRE"
REQUIRE_CUDA = "NVIDIA_REQUIRE_CUDA"
LEGACY = "CUDA_VERSION"
TRUE_VALUES = frozenset({"1", "t", "T", "true", "TRUE", "True"})  # Go's strconv.ParseBool
MAX_REQUIREMENT_BYTES = 64 << 10  # characters of one NVIDIA_REQUIRE_* value
MAX_ALTERNATIVES = 4096  # space-separated alternatives of one value
MAX_REQUIREMENTS = 64  # NVIDIA_REQUIRE_* variables
MAX_TOTAL_BYTES = 256 << 10  # characters of all of them together
BOUNDS_HINT = ("a CUDA image's requirement is a few hundred bytes; gpuhook reads at most "
               f"{MAX_REQUIREMENTS} variables of {MAX_REQUIREMENT_BYTES} characters and {MAX_ALTERNATIVES} "
               f"alternatives each, {MAX_TOTAL_BYTES} characters in all")

KEYS = ("cuda", "driver", "arch", "brand")
VERSION_KEYS = frozenset({"cuda", "driver", "arch"})
OPERATORS = ("=", "!=", "<", "<=", ">", ">=")
OPERATOR_CHARS = "<>=!"
SYNTAX_HINT = ("constraints are KEY OP VALUE with keys cuda, driver, arch, brand and operators "
               "= != < <= > >=; a space separates alternatives, a comma joins conditions")


class Constraint(record("Constraint", "text key operator value problem")):
    """One KEY OP VALUE condition as written. `problem` says why it is malformed (None if not);
    a malformed constraint is an error only when evaluation reaches it."""

    __slots__ = ()


class Requirement(record("Requirement", "variable text alternatives")):
    """One NVIDIA_REQUIRE_* variable: `alternatives` is a tuple of alternatives, each a tuple
    of Constraints that must all hold."""

    __slots__ = ()


def disabled(env) -> bool:
    """Whether the image turned requirement checks off (NVIDIA_DISABLE_REQUIRE)."""
    return env.get(DISABLE) in TRUE_VALUES


def collect(env) -> tuple:
    """The requirements an environment (name -> value) states, in variable-name order.
    Empty when there are none or NVIDIA_DISABLE_REQUIRE is set: no host facts are needed."""
    if disabled(env):
        return ()
    named = [(name, value) for name, value in env.items()
             if name.startswith(PREFIX) and not name.startswith(EXCLUDED_PREFIX) and value.strip(" ")]
    for name, value in named[:MAX_REQUIREMENTS + 1]:
        if len(value) > MAX_REQUIREMENT_BYTES or value.count(" ") >= MAX_ALTERNATIVES:
            raise RequirementError(f"{name} is too large ({len(value)} characters, {value.count(' ') + 1} "
                                   f"alternatives)", BOUNDS_HINT, variable=name)
    if len(named) > MAX_REQUIREMENTS or sum(len(value) for _, value in named) > MAX_TOTAL_BYTES:
        raise RequirementError(f"the image sets {len(named)} {PREFIX}* variables of "
                               f"{sum(len(value) for _, value in named)} characters", BOUNDS_HINT)
    found = [parse(name, value) for name, value in sorted(named)]
    legacy = env.get(LEGACY, "")
    if legacy and not env.get(REQUIRE_CUDA):
        found.append(parse(f"{LEGACY} (legacy image without {REQUIRE_CUDA})",
                           f"cuda>={_legacy_major_minor(legacy)}"))
    return tuple(found)


def parse(variable: str, text: str) -> Requirement:
    """Split a requirement into alternatives and constraints (malformed ones are kept, marked)."""
    alternatives = []
    for term in text.split(" "):
        constraints = tuple(_parse_constraint(part) for part in term.split(",") if part)
        if constraints:
            alternatives.append(constraints)
    return Requirement(variable, text, tuple(alternatives))


def _parse_constraint(text: str) -> Constraint:
    end = len(text)
    for i, char in enumerate(text):
        if char in OPERATOR_CHARS:
            end = i
            break
    key, rest = text[:end], text[end:]
    op_end = len(rest) - len(rest.lstrip(OPERATOR_CHARS))
    operator, value = rest[:op_end], rest[op_end:]
    problem = None
    if not key:
        problem = "no key before the operator"
    elif not operator:
        problem = "no operator (= != < <= > >=)"
    elif operator not in OPERATORS:
        problem = f"unknown operator {operator!r}"
    elif not value:
        problem = "no value after the operator"
    elif key.lower() not in KEYS:
        problem = f"unknown key {key!r} (keys are cuda, driver, arch, brand)"
    return Constraint(text, key.lower(), operator, value, problem)


MAX_VERSION_PART = 18


def _legacy_major_minor(version: str) -> str:
    """MAJOR.MINOR of a CUDA_VERSION, read as a semantic version as NVIDIA's toolkit does."""
    core = version[1:] if version.startswith("v") else version
    core, plus, build = core.partition("+")
    core, dash, prerelease = core.partition("-")
    parts = core.split(".")
    valid = (
        1 <= len(parts) <= 3
        and all(p.isdigit() and p.isascii() and len(p) <= MAX_VERSION_PART and (p == "0" or not p.startswith("0"))
                for p in parts)
        and (not (dash or plus) or len(parts) == 3)
        and all(_semver_identifiers(x) for x, present in ((prerelease, dash), (build, plus)) if present)
    )
    if not valid:
        raise RequirementError(f"{LEGACY}={version!r} is not a valid version",
                               "a legacy CUDA image's CUDA_VERSION looks like 12.2.0", variable=LEGACY,
                               constraint=version)
    return f"{int(parts[0])}.{int(parts[1]) if len(parts) > 1 else 0}"


def _semver_identifiers(text: str) -> bool:
    return all(part and all(c.isascii() and (c.isalnum() or c == "-") for c in part) for part in text.split("."))
