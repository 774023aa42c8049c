"""Human-readable lines for ``ogrefs show``: latest coherent checkpoint first."""

from __future__ import annotations

from ogrefs.inspect.ckptrules import FRAMEWORK_NAMES
from ogrefs.inspect.compare import gpu_summary
from ogrefs.inspect.release import release_name

__all__ = ["format_environment", "format_checkpoint"]


def _gib(n) -> str:
    return f"{n / (1 << 30):.1f} GiB" if isinstance(n, (int, float)) else "?"


def _size(n) -> str:
    if not isinstance(n, (int, float)):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "?"  # pragma: no cover


def format_checkpoint(c: dict) -> str:
    bits = [c.get("format") or "?"]
    if c.get("step") is not None:
        bits.append(f"step {c['step']}")
    if c.get("epoch") is not None:
        bits.append(f"epoch {c['epoch']:g}")
    comps = ", ".join(c.get("components") or []) or "no components"
    return f"{c.get('id')} ({'; '.join(bits)}; {comps}; {_size(c.get('size'))})"


def _where(c: dict) -> str:
    if c.get("step") is not None:
        return f"step {c['step']}"
    return f"epoch {c['epoch']:g}" if c.get("epoch") is not None else "no step recorded"


def _run_lines(run: dict) -> list[str]:
    """A run's framework, what it would resume from and why, and where that and the most advanced disagree."""
    lines = []
    resume = run.get("resume") or {}
    if run.get("checkpoints"):
        fmt = run.get("framework") or "?"
        head = f"Run {run.get('dir')} ({FRAMEWORK_NAMES.get(fmt, fmt)}): "
        if resume.get("id"):
            state = "coherent" if resume.get("coherent") else "NOT coherent"
            head += f"resumes from {resume.get('name')} ({_where(resume)}, {state}; {resume.get('rule')})"
        else:
            head += resume.get("rule") or "no resume target"
        adv = next((c for c in run["checkpoints"] if c.get("id") == run.get("most_advanced_coherent")), None)
        if adv is not None and adv.get("id") != resume.get("id"):
            head += f"; most advanced coherent: {adv.get('name')} ({_where(adv)})"
        lines.append(head)
    for p in run.get("problems") or []:
        lines.append(f"  problem: {p}")
    for p in run.get("pointers", []):
        if p.get("problem"):
            lines.append(f"  pointer {p['path']}: {p['problem']}")
    return lines


def format_environment(env: dict) -> list[str]:
    """Lines describing a manifest, most useful first."""
    lines: list[str] = []
    ck = env.get("checkpoints") or {}
    latest = ck.get("latest_coherent")
    if latest:
        lines.append(f"Latest coherent checkpoint: {format_checkpoint(latest)}")
        for e in latest.get("evidence", [])[:8]:
            lines.append(f"    because: {e}")
        for w in latest.get("warnings", []):
            lines.append(f"    warning: {w}")
    elif ck.get("count"):
        lines.append("Latest coherent checkpoint: none of the checkpoints found is coherent")
    else:
        lines.append("Checkpoints: none found")
    for run in ck.get("runs", []):
        lines += _run_lines(run)
    bad = ck.get("incomplete") or []
    if bad:
        lines.append(f"Not usable ({len(bad)}):")
        for b in bad[:20]:
            lines.append(f"  {b.get('id')}: {b.get('reason')}")
        if len(bad) > 20:
            lines.append(f"  ... and {len(bad) - 20} more")
    n_ok = (ck.get("count") or 0) - len(bad) - (1 if latest else 0)
    if n_ok > 0:
        lines.append(f"Other coherent checkpoints: {n_ok}")

    m = env.get("machine") or {}
    if m:
        cpu = m.get("cpu") or {}
        lines.append(
            f"Machine: {m.get('hostname')}, {release_name(m)}, "
            f"kernel {m.get('kernel')}, {m.get('arch')}, {cpu.get('count')}x {cpu.get('model') or 'CPU'}, "
            f"{_gib(m.get('memory_bytes'))} RAM"
        )
    g = env.get("gpus") or {}
    if g.get("available"):
        mem = {d.get("memory_bytes") for d in g.get("devices", [])}
        mem_s = f" ({_gib(mem.pop())} each)" if len(mem) == 1 else ""
        lines.append(
            f"GPUs: {gpu_summary(g)}{mem_s}, driver {g.get('driver_version')}, "
            f"CUDA driver API {g.get('cuda_driver_version')}"
        )
    else:
        lines.append(f"GPUs: {gpu_summary(g)}")
    c = env.get("cuda") or {}
    parts = [f"CUDA {t.get('version') or '?'} at {t.get('path')}" for t in c.get("toolkits", [])]
    parts += [f"cuDNN {x['version']} ({x['path']})" for x in c.get("cudnn", [])]
    parts += [f"NCCL {x['version']} ({x['path']})" for x in c.get("nccl", [])]
    if parts:
        lines.append("CUDA: " + "; ".join(parts))
    for e in env.get("python_envs") or []:
        desc = f"Python env {e.get('path')} ({e.get('kind')}, Python {e.get('python') or '?'}, {e.get('package_count', 0)} packages"
        t = e.get("torch")
        if t:
            desc += f", torch {t.get('version')}" + (f" built for CUDA {t['cuda']}" if t.get("cuda") else " CPU-only")
        lines.append(desc + ")")
    for r in env.get("git") or []:
        head = (r.get("head") or "no commit")[:12]
        state = {True: "uncommitted changes", False: "clean"}.get(r.get("dirty"), "changes unknown")
        if r.get("untracked"):
            state += f", {r['untracked']} untracked"
        branch = r.get("branch") or ("detached" if r.get("detached") else "?")
        lines.append(f"Git {r.get('path')}: {head} on {branch}, {state}")
    for n in env.get("notes") or []:
        lines.append(f"Note: {n}")
    return lines
