"""Compare two manifests, or a manifest with the machine it is restored on."""

from __future__ import annotations

import re

__all__ = ["diff_environments", "compatibility_warnings", "gpu_summary", "version_key"]

_RELEASE_RE = re.compile(r"^v?(\d+(?:\.\d+)*)")


def version_key(v: str | None) -> tuple[int, ...] | None:
    """Numeric release tuple of a version string ("2.1.0+cu121" -> (2, 1, 0))."""
    if not v:
        return None
    m = _RELEASE_RE.match(v.strip())
    if not m:
        return None
    parts = [int(x) for x in m.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def _gpus_available(g: dict | None) -> bool:
    return bool(g and g.get("available") and g.get("count", 0) > 0)


def gpu_summary(g: dict | None) -> str:
    """"8x NVIDIA H100 80GB HBM3" style text, or "no GPU (<reason>)"."""
    if not _gpus_available(g):
        reason = (g or {}).get("reason") or "not recorded"
        return f"no GPU ({reason})"
    counts: dict[str, int] = {}
    for d in g.get("devices", []):
        label = d.get("name") or "unknown GPU"
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{n}x {label}" for label, n in counts.items()) or f"{g.get('count')} GPU(s)"


def _ccs(g: dict | None) -> set[str]:
    return {d["compute_capability"] for d in (g or {}).get("devices", []) if d.get("compute_capability")}


def _names(g: dict | None) -> set[str]:
    return {d["name"] for d in (g or {}).get("devices", []) if d.get("name")}


def _pair(a, b):
    return [a, b] if a != b else None


def _diff_packages(pa: dict, pb: dict) -> dict:
    out: dict = {"added": {}, "removed": {}, "upgraded": {}, "downgraded": {}, "changed": {}}
    for name in sorted(set(pa) | set(pb)):
        if name not in pa:
            out["added"][name] = pb[name]
        elif name not in pb:
            out["removed"][name] = pa[name]
        elif pa[name] != pb[name]:
            ka, kb = version_key(pa[name]), version_key(pb[name])
            bucket = "changed"
            if ka is not None and kb is not None and ka != kb:
                bucket = "upgraded" if kb > ka else "downgraded"
            out[bucket][name] = [pa[name], pb[name]]
    return {k: v for k, v in out.items() if v}


def _by(items: list[dict] | None, key: str) -> dict:
    return {i.get(key): i for i in (items or []) if isinstance(i, dict)}


def _all_checkpoints(env: dict) -> dict:
    out = {}
    for run in (env.get("checkpoints") or {}).get("runs", []):
        for c in run.get("checkpoints", []):
            out[c["id"]] = c
    return out


def diff_environments(a: dict, b: dict) -> dict:
    """What changed from manifest ``a`` to manifest ``b``.

    Only sections with differences appear; ``{}`` means no differences.
    """
    out: dict = {}
    if machine := _diff_machine(a.get("machine") or {}, b.get("machine") or {}):
        out["machine"] = machine
    out.update(_diff_gpus(a.get("gpus") or {}, b.get("gpus") or {}))
    for section, diff in (("cuda", _diff_cuda), ("python_envs", _diff_envs), ("git", _diff_git),
                          ("checkpoints", _diff_checkpoints)):
        if d := diff(a, b):
            out[section] = d
    return out


_MACHINE_FIELDS = (
    ("hostname", lambda m: m.get("hostname")),
    ("os", lambda m: (m.get("os") or {}).get("pretty_name")),
    ("kernel", lambda m: m.get("kernel")),
    ("arch", lambda m: m.get("arch")),
    ("cpu_model", lambda m: (m.get("cpu") or {}).get("model")),
    ("cpu_count", lambda m: (m.get("cpu") or {}).get("count")),
    ("memory_bytes", lambda m: m.get("memory_bytes")),
)


def _diff_machine(ma: dict, mb: dict) -> dict:
    return {label: p for label, get in _MACHINE_FIELDS if (p := _pair(get(ma), get(mb)))}


def _diff_gpus(ga: dict, gb: dict) -> dict:
    """The top-level ``gpus``, ``driver_version`` and ``cuda_driver_version`` entries that changed."""
    out: dict = {}
    if gpu_summary(ga) != gpu_summary(gb):
        out["gpus"] = [gpu_summary(ga), gpu_summary(gb)]
    for key in ("driver_version", "cuda_driver_version"):
        if p := _pair(ga.get(key), gb.get(key)):
            out[key] = p
    return out


def _diff_cuda(a: dict, b: dict) -> dict:
    ca, cb = a.get("cuda") or {}, b.get("cuda") or {}
    cuda = {}
    for section, key in (("toolkits", "path"), ("cudnn", "path"), ("nccl", "path")):
        xa = {f"{k}: {v.get('version')}" for k, v in _by(ca.get(section), key).items()}
        xb = {f"{k}: {v.get('version')}" for k, v in _by(cb.get(section), key).items()}
        if xa != xb:
            cuda[section] = {"removed": sorted(xa - xb), "added": sorted(xb - xa)}
    return cuda


def _added_removed(xa: dict, xb: dict) -> dict:
    """``added``/``removed`` keys from ``xa`` to ``xb``, each only when not empty."""
    out: dict = {}
    if set(xb) - set(xa):
        out["added"] = sorted(set(xb) - set(xa))
    if set(xa) - set(xb):
        out["removed"] = sorted(set(xa) - set(xb))
    return out


def _diff_envs(a: dict, b: dict) -> dict:
    ea, eb = _by(a.get("python_envs"), "path"), _by(b.get("python_envs"), "path")
    envs = _added_removed(ea, eb)
    changed = {path: d for path in sorted(set(ea) & set(eb)) if (d := _diff_env(ea[path], eb[path]))}
    if changed:
        envs["changed"] = changed
    return envs


def _diff_env(x: dict, y: dict) -> dict:
    """One Python environment's packages (and conda's), interpreter and torch's CUDA."""
    d = _diff_packages(x.get("packages") or {}, y.get("packages") or {})
    if x.get("kind") == "conda" or y.get("kind") == "conda":
        dc = _diff_packages(x.get("conda_packages") or {}, y.get("conda_packages") or {})
        if dc:
            d["conda"] = dc
    if p := _pair(x.get("python"), y.get("python")):
        d["python"] = p
    if p := _pair((x.get("torch") or {}).get("cuda"), (y.get("torch") or {}).get("cuda")):
        d["torch_cuda"] = p
    return d


def _diff_git(a: dict, b: dict) -> dict:
    ra, rb = _by(a.get("git"), "path"), _by(b.get("git"), "path")
    git = _added_removed(ra, rb)
    changed = {}
    for path in sorted(set(ra) & set(rb)):
        d = {k: p for k in ("head", "branch", "dirty") if (p := _pair(ra[path].get(k), rb[path].get(k)))}
        if d:
            changed[path] = d
    if changed:
        git["changed"] = changed
    return git


def _diff_checkpoints(a: dict, b: dict) -> dict:
    ka, kb = _all_checkpoints(a), _all_checkpoints(b)
    ck = _added_removed(ka, kb)
    changed = {}
    for cid in sorted(set(ka) & set(kb)):
        d = {k: p for k in ("coherent", "complete", "step", "size") if (p := _pair(ka[cid].get(k), kb[cid].get(k)))}
        if d:
            changed[cid] = d
    if changed:
        ck["changed"] = changed
    la = ((a.get("checkpoints") or {}).get("latest_coherent") or {}).get("id")
    lb = ((b.get("checkpoints") or {}).get("latest_coherent") or {}).get("id")
    if la != lb:
        ck["latest_coherent"] = [la, lb]
    return ck


def compatibility_warnings(snapshot_env: dict, here: dict) -> list[str]:
    """One sentence per way this machine differs from the snapshot's in a way that bites.

    ``here`` is :func:`ogrefs.inspect.probe_local_machine` output (or a full
    manifest).
    """
    warnings: list[str] = []
    sm, hm = snapshot_env.get("machine") or {}, here.get("machine") or {}
    if sm.get("arch") and hm.get("arch") and sm["arch"] != hm["arch"]:
        warnings.append(
            f"The snapshot was taken on a {sm['arch']} machine but this one is {hm['arch']}, "
            "so its compiled Python extensions and CUDA libraries will not run here."
        )
    sg, hg = snapshot_env.get("gpus") or {}, here.get("gpus") or {}
    if _gpus_available(sg) and not _gpus_available(hg):
        warnings.append(
            f"The snapshot was taken with {gpu_summary(sg)}, but no GPU is usable here "
            f"({hg.get('reason') or 'no NVIDIA driver answered'}), so training code will fall back to CPU or fail."
        )
        return warnings
    if not _gpus_available(hg):
        return warnings
    driver_cuda = version_key(hg.get("cuda_driver_version"))
    if driver_cuda is not None:
        for tk in (snapshot_env.get("cuda") or {}).get("toolkits") or []:
            need = version_key(tk.get("version"))
            if need is not None and need[:2] > driver_cuda[:2]:
                warnings.append(
                    f"The snapshot's CUDA toolkit {tk.get('version')} at {tk.get('path')} needs a newer driver "
                    f"than this machine's {hg.get('driver_version')} (CUDA up to {hg.get('cuda_driver_version')}); "
                    "its programs will fail with CUDA_ERROR_UNSUPPORTED_PTX_VERSION or 'driver too old'."
                )
        for env in snapshot_env.get("python_envs") or []:
            torch = env.get("torch") or {}
            built = version_key(torch.get("cuda"))
            if built is not None and built > driver_cuda:
                warnings.append(
                    f"PyTorch {torch.get('version')} in {env.get('path')} was built for CUDA "
                    f"{torch.get('cuda')}, but this machine's driver {hg.get('driver_version')} "
                    f"supports CUDA only up to {hg.get('cuda_driver_version')}; upgrade the driver "
                    "or expect CUDA initialisation errors."
                )
    if _gpus_available(sg):
        s_cc, h_cc = _ccs(sg), _ccs(hg)
        if s_cc and h_cc and s_cc != h_cc:
            warnings.append(
                f"The snapshot's GPUs ({gpu_summary(sg)}, compute capability {', '.join(sorted(s_cc))}) "
                f"differ in architecture from this machine's ({gpu_summary(hg)}, compute capability "
                f"{', '.join(sorted(h_cc))}), so kernels compiled only for the old architecture "
                "(custom extensions, Triton or TensorRT caches) may fail or be rebuilt."
            )
        elif _names(sg) and _names(hg) and _names(sg) != _names(hg):
            warnings.append(
                f"The snapshot was taken on {gpu_summary(sg)} and this machine has {gpu_summary(hg)}; "
                "the architecture matches, but memory size and tuned settings (batch size, autotune caches) may not."
            )
        sc, hc = sg.get("count", 0), hg.get("count", 0)
        if hc < sc:
            warnings.append(
                f"This machine has {hc} GPU(s) where the snapshot had {sc}, so distributed launch "
                "settings and sharded checkpoints may need a different world size."
            )
    return warnings
