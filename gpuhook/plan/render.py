"""A plan for people: the text `gpuhook prestart --dry-run` prints without --json."""

from gpuhook.plan.records import Plan, ProcMask


def render_text(plan: Plan) -> str:
    """The plan for people: what --dry-run prints without --json."""
    lines = [f"container {plan.container_id}  pid {plan.pid or '-'}  rootfs {plan.rootfs}"]
    if plan.empty:
        lines.append("request: none; the hook leaves this container untouched")
        lines += [f"note: {n}" for n in plan.notes]
        return "\n".join(lines) + "\n"
    gpus = ", ".join(f"{g.index} {g.uuid} ({g.bus_id}, {g.model})" for g in plan.gpus) or "none"
    lines.append(f"request: {plan.wants} via {plan.channel}")
    lines.append(f"capabilities: {','.join(sorted(plan.capabilities))}")
    lines.append(f"gpus: {gpus}")
    if plan.migs:
        lines.append("mig devices: " + ", ".join(
            f"{m.label} {m.uuid} ({m.name}, gi {m.gpu_instance_id} ci {m.compute_instance_id})" for m in plan.migs))
    lines.append("device nodes:")
    lines += [f"  {n.path:<28} c {n.major}:{n.minor}  {n.mode:04o} {n.uid}:{n.gid}"
              + (f"  (bind of {n.host_path})" if n.host_path else "") for n in plan.nodes]
    lines.append("cgroup rules:")
    lines += [f"  allow {r.v1_line()}" for r in plan.rules]
    lines.append("mounts:")
    lines += [f"  {m.target}  <-  {m.source}  ({','.join(m.options)})" for m in plan.mounts]
    lines.append("symlinks:")
    lines += [f"  {s.path} -> {s.target}" for s in plan.symlinks]
    if plan.proc_mask:
        lines.append(f"proc: {ProcMask.target} masked read-only (ModifyDeviceFiles: 0; "
                     f"GPU dirs {', '.join(plan.proc_mask.gpu_buses) or 'none'})")
    if plan.ldcache:
        lines.append(f"ld cache: host ldconfig for {', '.join(plan.ldcache.directories)}")
    if plan.health:
        skip = ", skipping a GPU with a fresh stamp made for this container's allocation" \
            if plan.health.mode == "fallback" and plan.health.allocations else ""
        lines.append(f"health ({plan.health.mode}, on failure: {plan.health.on_failure}): while the rest is "
                     f"applied, check and repair {', '.join(plan.health.gpus)} within "
                     f"{plan.health.deadline_seconds:g} s{skip}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines) + "\n"
