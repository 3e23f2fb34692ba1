"""Site-packages for a hook started with ``python3 -I -S``.

Its own module so that any layer (the CLI entry, NVML loading) can call it without importing
the entry point: gpuhook.discover.nvml once imported gpuhook.entry for it, which closed an import
circle entry -> hook -> health -> nvml -> entry.
"""

import sys


def enable_site_packages() -> None:
    """Add site-packages to sys.path: the runtime starts the hook with -S (no site.py), which
    keeps the hook's paths bare; call this just before importing a dependency (pynvml,
    click, yaml). With -I the user site and PYTHON* variables stay ignored."""
    if sys.flags.no_site and "site" not in sys.modules:
        import site

        site.main()
