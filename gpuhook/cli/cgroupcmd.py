"""`gpuhook cgroup show`: the device rules in effect for a container, v1 or v2."""

import json

import click

SYSTEMD_UNKNOWN = "NOT KNOWN"


@click.group(name="cgroup", help="Inspect the device cgroup of a running container.")
def cgroup():
    pass


@cgroup.command(name="show", short_help="Print a container's device rules and whether systemd knows them.", help=(
    "Print the device rules in effect for a container: on cgroup v1 the cgroup's devices.list, "
    "on cgroup v2 every attached device program decoded into rules (first match wins; an "
    "access needs every program's allow). On v2 the rules gpuhook added are marked (v1 keeps "
    "no record of who added a rule); on both, allowed devices the container's systemd scope "
    "does not know are flagged (a daemon-reload would remove them)."))
@click.option("--pid", type=int, metavar="PID", help="A process in the container (e.g. the pid `runc state` shows).")
@click.option("--path", "directory", metavar="CGROUP_DIR", help="The container's cgroup directory instead of a pid.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def show(pid, directory, as_json):
    if (pid is None) == (directory is None):
        raise click.UsageError("give either --pid PID or --path CGROUP_DIR")
    from gpuhook.apply.cgroup import hierarchy, v2

    place = hierarchy.placement(pid) if pid is not None else v2.placement_of_directory(directory)
    report = v2.describe(place)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
        return
    click.echo("\n".join(render(report)))


def _row_cells(index, rule, source, unknown) -> list:
    major = "*" if rule.major == -1 else str(rule.major)
    minor = "*" if rule.minor == -1 else str(rule.minor)
    return [str(index), "allow" if rule.allow else "deny", rule.type, f"{major}:{minor}", rule.access, source,
            SYSTEMD_UNKNOWN if rule.allow and rule in unknown else ""]


def _table(rows) -> list:
    header = ["#", "verdict", "type", "device", "access", "from", "systemd"]
    widths = [max(len(r[k]) for r in [header] + rows) for k in range(len(header))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header] + rows]


def render(report) -> list:
    """The report as lines of text: a header, one table per rule list, the systemd verdict."""
    unknown = report.systemd.at_risk
    lines = [f"cgroup {report.mode}  {report.directory}  (cgroup path {report.cgroup_path})"]
    if report.mode == "v1":
        lines.append("devices.list (allowed devices):")
        lines += _table([_row_cells(i + 1, rule, "", unknown) for i, rule in enumerate(report.rules)])
    elif not report.programs:
        lines.append("no device program attached: every device is allowed (a privileged container)")
    else:
        for prog in report.programs:
            where = "inherited from an ancestor cgroup" if prog.inherited else "attached here"
            name = prog.name or "(no name)"
            lines.append(f"program {prog.id}  {name}  tag {prog.tag}  {where}  {prog.instructions} instructions")
            if prog.rules is None:
                lines.append(f"  cannot decode: {prog.error}")
                lines += ["  " + text for text in prog.disassembly]
                continue
            mine = len(prog.ours)
            lines += _table([_row_cells(i + 1, rule, "gpuhook" if i < mine else "", unknown)
                             for i, rule in enumerate(prog.rules)])
        if len(report.programs) > 1:
            lines.append("an access is allowed only if every program above allows it")
    lines.append(report.systemd.summary())
    return lines
