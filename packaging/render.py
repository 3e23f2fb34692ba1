#!/usr/bin/env python3
"""Files the packages ship that are generated from gpuhook's code, so they never drift from it.

    packaging/render.py hooks-d [--launcher PATH] [--python PATH] [--front PATH] [--annotated]
                                [--stage STAGE]                  an oci-hooks file (stdout)
    packaging/render.py config                                   /etc/gpuhook/config.toml
    packaging/render.py manpage                                  gpuhook(1) in roff

Run from a source tree (packaging/build-deb, packaging/build-rpm and the tests do); it imports
gpuhook from the tree it sits in. The manual page needs click (a build dependency).
"""

import argparse
import inspect
import json
import os
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpuhook import __version__  # noqa: E402
from gpuhook import config as cfg  # noqa: E402
from gpuhook import install  # noqa: E402

CONFIG_HEADER = f"""\
# gpuhook configuration (TOML), read by the hook at every container start.
#
# Every key is listed with its default value, commented out: uncomment a line to change it.
# `gpuhook config` shows the effective values. Which file is read, first match wins:
# `--config FILE` in the hook's arguments, ${cfg.ENV_VAR}, {cfg.DEFAULT_PATH}.
"""


def toml_value(value) -> str:
    """A TOML literal for a default value (bool, number or string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def config_text() -> str:
    """The default config.toml: every key of gpuhook.config.KEYS with its doc and default."""
    out = [CONFIG_HEADER]
    section = ""
    for key in cfg.KEYS:
        if key.section != section:
            section = key.section
            out.append(f"\n# [{section}]\n")
        doc = textwrap.wrap(key.doc, width=88, initial_indent="# ", subsequent_indent="# ")
        if key.choices:
            doc.append(f"# One of: {', '.join(key.choices)}.")
        out.append("\n" + "\n".join(doc) + f"\n# {key.name} = {toml_value(key.default)}\n")
    return "".join(out)


def _roff(text: str) -> str:
    """Text safe for roff: backslashes escaped, no line starting with a control character."""
    lines = text.replace("\\", "\\e").splitlines()
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in lines)


def _paragraphs(text: str) -> list:
    return [" ".join(p.split()) for p in inspect.cleandoc(text or "").split("\n\n") if p.strip()]


def manpage_text() -> str:
    """gpuhook(1): the description, every command with its options, files, configuration."""
    import click

    from gpuhook.cli import COMMANDS, cli

    ctx = click.Context(cli, info_name="gpuhook")
    summary, *body = _paragraphs(cli.help)
    out = [f'.TH GPUHOOK 1 "" "gpuhook {__version__}" "User Commands"',
           ".SH NAME", "gpuhook \\- " + _roff(summary.split(": ", 1)[-1].rstrip(".")),
           ".SH SYNOPSIS", ".B gpuhook", "\\fICOMMAND\\fR [\\fIOPTIONS\\fR] [\\fIARGUMENTS\\fR]",
           ".br", ".B gpuhook", "[\\fB\\-\\-version\\fR] [\\fB\\-\\-help\\fR]",
           ".SH DESCRIPTION"]
    for paragraph in body:
        out += [".PP", _roff(paragraph)]
    out.append(".SH COMMANDS")
    for name in COMMANDS:
        command = cli.get_command(ctx, name)
        sub = click.Context(command, info_name=name, parent=ctx)
        usage = " ".join(command.collect_usage_pieces(sub))
        out += [".SS " + _roff(f"gpuhook {name} {usage}")]
        for paragraph in _paragraphs(command.help):
            out += [".PP", _roff(paragraph)]
        for param in command.get_params(sub):
            record = None if param.name == "help" else param.get_help_record(sub)
            if record:
                out += [".TP", "\\fB" + _roff(record[0]).replace("-", "\\-") + "\\fR", _roff(record[1])]
    out += [".SH CONFIGURATION",
            ".PP", _roff(f"{cfg.DEFAULT_PATH} (TOML). Unknown keys and bad values are errors that name the "
                         "key and the file. Keys and defaults:")]
    for key in cfg.KEYS:
        out += [".TP", "\\fB" + _roff(key.dotted).replace("-", "\\-") + "\\fR = " + _roff(toml_value(key.default)),
                _roff(key.doc)]
    from gpuhook.errors import EXIT_CODES

    out.append(".SH EXIT STATUS")
    for code, meaning in EXIT_CODES.items():
        out += [".TP", f"\\fB{code}\\fR", _roff(meaning[0].upper() + meaning[1:] + ".")]
    out += [".SH ENVIRONMENT", ".TP", f"\\fB{cfg.ENV_VAR}\\fR",
            _roff("Configuration file for commands run by hand. The hook's own environment is only PATH; "
                  "give it a file with --config (gpuhook install --config FILE does)."),
            ".SH FILES",
            ".TP", _roff(cfg.DEFAULT_PATH), "The configuration (a conffile of the package).",
            ".TP", _roff(f"{install.PACKAGE_HOOKS_DIR}/{install.HOOK_FILE_NAME}"),
            "The packaged oci\\-hooks file for the prestart stage: podman and CRI\\-O run gpuhook for "
            "every container.",
            ".TP", _roff(f"{install.PACKAGE_HOOKS_DIR}/{install.POSTSTOP_FILE_NAME}"),
            "The packaged oci\\-hooks file for the poststop stage: gpuhook cleans up the GPUs a stopped "
            "container used.",
            ".TP", _roff(f"{install.ADMIN_HOOKS_DIR}/{install.HOOK_FILE_NAME}, "
                         f"{install.ADMIN_HOOKS_DIR}/{install.POSTSTOP_FILE_NAME}"),
            "Written by \\fBgpuhook install podman\\fR; each overrides the packaged file of the same name.",
            ".TP", _roff(install.CONTAINERD_SPEC),
            "Written by \\fBgpuhook install containerd\\fR: containerd's default spec plus the hooks.",
            ".TP", _roff(str(cfg.default("log-file"))), "Decision log (JSON lines), see log\\-file.",
            ".SH SEE ALSO", "podman(1), runc(8), crun(1), containerd(8), ctr(8)"]
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    hooks = sub.add_parser("hooks-d", help="an oci-hooks file podman and CRI-O read")
    hooks.add_argument("--launcher", default=install.DEBIAN_LAUNCHER, help="installed gpuhook/launch.py")
    hooks.add_argument("--python", default=install.SYSTEM_PYTHON, help="the interpreter that runs it")
    hooks.add_argument("--front", default=None, metavar="PATH",
                       help="the installed native front that runs the Python command (the packages: "
                            f"{install.PACKAGED_FRONT}) [default: none, the Python command alone]")
    hooks.add_argument("--annotated", action="store_true", help="the CDI-annotation-gated variant")
    hooks.add_argument("--stage", choices=install.STAGES, default=install.STAGE,
                       help=f"the stage the file registers (one file per stage) [default: {install.STAGE}]")
    sub.add_parser("config", help="the default /etc/gpuhook/config.toml")
    sub.add_parser("manpage", help="gpuhook(1)")
    args = parser.parse_args(argv)
    if args.what == "hooks-d":
        text = install.render_json(install.hooks_d_document(install.packaged_hook(args.launcher, args.python, args.front), args.annotated,
                                                            args.stage))
    elif args.what == "config":
        text = config_text()
    else:
        text = manpage_text()
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
