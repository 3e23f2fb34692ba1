"""GPU health: every GPU is checked, cleaned and healthy before a container gets it (docs/health.md).

The Kubernetes device plugin API lets a plugin clean a device in PreStartContainer, but it
is opt-in, has a 30 s budget, does not say which container, and no vendor plugin does it.
gpuhook does the work in its prestart hook whenever the plugin did not, and offers the same
code to plugins, so both run one implementation (docs/health.md).

    prepare(uuids, config, allocation=TOKEN) -> engine.Report   check and repair; stamp each
                                               GPU that is fine for the start carrying TOKEN;
                                               raise GpuUnhealthyError / HealthDeadlineError
    check(uuids, config, repair=False) -> engine.Report   the checks, no actions unless repair

Modules: checks (the rules, pure), owners (who owns a GPU process), registry (containers
gpuhook started), actions (kill, reset), store (reports, stamps, locks), engine (parallel
runs within a deadline), hooks (the hook's stages).

Importing this package imports nothing else: the functions below load the engine (NVML,
threads) when called, so `gpuhook.health.registry` stays cheap to import on its own.
"""


def prepare(uuids, config, deadline_seconds: float | None = None, allocation: str | None = None):
    """See gpuhook.health.engine.prepare."""
    from gpuhook.health import engine

    return engine.prepare(uuids, config, deadline_seconds, allocation)


def check(uuids, config, repair: bool = False, deadline_seconds: float | None = None):
    """See gpuhook.health.engine.check."""
    from gpuhook.health import engine

    return engine.check(uuids, config, repair, deadline_seconds)
