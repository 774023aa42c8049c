"""Check one checkpoint file: is it whole, and what does it hold?

Each check reads headers and indexes, never tensor data, and never
unpickles (pickles are read with :mod:`ogrefs.inspect.pickle_scan`):

* torch.save zip files: the central directory must parse, every member's
  local header must sit where the directory says and its data must end
  inside the file; ``data.pkl`` is read (zipfile checks its CRC) and
  every storage it references must have a ``data/<key>`` member.  Large
  members are not read, so bit rot inside tensor data is not detected.
* safetensors: the 8-byte header length, the JSON header, each tensor's
  byte range against its dtype and shape, and the sum against the file
  size.
* legacy (pre-1.6, or ``_use_new_zipfile_serialization=False``) torch.save
  files, as far as their structure allows without unpickling: five
  pickles in a row (magic number, protocol, sys_info, the object, the
  storage keys) and then each storage's raw bytes behind an 8-byte element
  count; every storage the object names must be there with the count the
  object records, and the file must end where the last one ends.
* JSON records (``trainer_state.json``, ``*.index.json``) and
  ``torch.distributed.checkpoint`` ``.metadata`` files.
"""

from __future__ import annotations

import io
import json
import os
import pickletools
import re
import struct
import zipfile
from dataclasses import dataclass, field

from ogrefs.inspect.deadline import Deadline
from ogrefs.inspect.pickle_scan import PickleSummary, scan_pickle
from ogrefs.inspect.files import open_regular

__all__ = [
    "FileCheck",
    "check_file",
    "kind_from_name",
    "components_from_name",
    "components_from_pickle",
    "TORCH_LEGACY_MAGIC",
]

#: ``torch.save`` before 1.6 starts with PROTO 2 then this LONG1 number.
TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C

_MAX_PICKLE_BYTES = 64 << 20
_MAX_JSON_BYTES = 64 << 20
_MAX_SAFETENSORS_HEADER = 100 << 20
_MAX_ZIP_MEMBERS = 500_000

_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
    "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8, "C128": 16,
}

_MODEL_KEYS = {
    "state_dict", "model", "model_state_dict", "model_state", "module",
    "net", "network", "ema", "ema_state_dict", "model_ema", "generator",
    "discriminator", "weights", "params", "teacher", "student",
}
_OPTIMIZER_KEYS = {
    "optimizer", "optimizers", "optimizer_states", "optimizer_state_dict",
    "optimizer_state", "optim", "opt", "optim_state", "optimizer_state_dicts",
}
_SCHEDULER_KEYS = {
    "lr_scheduler", "lr_schedulers", "scheduler", "schedulers",
    "scheduler_state_dict", "sched", "lr_scheduler_state_dict", "opt_param_scheduler",
}
_RNG_KEYS = {
    "rng_state", "rng_states", "rng", "random_state", "random_states",
    "torch_rng_state", "cuda_rng_state", "numpy_rng_state", "py_rng_state",
}
_STEP_KEYS = ("global_step", "global_steps", "step", "iteration", "iter", "steps", "num_updates")
_EPOCH_KEYS = ("epoch", "epochs", "cur_epoch", "current_epoch")
_PROGRESS_KEYS = set(_STEP_KEYS) | set(_EPOCH_KEYS) | {
    "loops", "global_samples", "trainer_state", "iteration_count",
}


@dataclass
class FileCheck:
    """The verdict on one file.  ``ok``: True intact, False damaged, None unknown."""

    path: str
    size: int = 0
    mtime: float = 0.0
    kind: str = "unknown"
    ok: bool | None = None
    problems: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    components: set[str] = field(default_factory=set)
    step: int | None = None
    epoch: float | None = None
    #: small facts other checks need: trainer_state fields, index shard
    #: names, DeepSpeed world sizes, DCP shard names and extents, ...
    facts: dict = field(default_factory=dict)
    unusual_globals: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        out = {
            "path": self.path,
            "size": self.size,
            "kind": self.kind,
            "ok": self.ok,
        }
        if self.problems:
            out["problems"] = list(self.problems)
        if self.unusual_globals:
            out["unusual_globals"] = list(self.unusual_globals)
        # the rest lets a later snapshot reuse this verdict for a file it knows unchanged
        # (a box running from an ogrefs mount: reading it again would fetch it)
        out["verdict"] = {"mtime": self.mtime, "evidence": list(self.evidence),
                          "components": sorted(self.components), "step": self.step, "epoch": self.epoch,
                          "facts": self.facts}
        return out

    @classmethod
    def from_json(cls, d: dict) -> "FileCheck | None":
        """The verdict recorded by :meth:`to_json`, or None if it was recorded without one (older manifests)."""
        v = d.get("verdict")
        if not isinstance(v, dict):
            return None
        try:
            return cls(path=d["path"], size=int(d["size"]), mtime=float(v["mtime"]), kind=str(d["kind"]),
                       ok=d["ok"], problems=list(d.get("problems", [])), evidence=list(v["evidence"]),
                       components=set(v["components"]), step=v["step"], epoch=v["epoch"], facts=dict(v["facts"]),
                       unusual_globals=list(d.get("unusual_globals", [])))
        except (KeyError, TypeError, ValueError):
            return None


_TOKEN_SPLIT = re.compile(r"[^a-z0-9]+")


def kind_from_name(name: str) -> str:
    """What part a file plays in a checkpoint, judged by its name.

    One of "progress", "index", "dcp-metadata", "dcp-shard", "args",
    "other-json" or "data" (weights / optimizer / ... holders).
    """
    n = name.lower()
    if n == "trainer_state.json":
        return "progress"
    if n.endswith(".index.json"):
        return "index"
    if n == ".metadata":
        return "dcp-metadata"
    if n.endswith(".distcp"):
        return "dcp-shard"
    if n.startswith("training_args."):
        return "args"
    if n.endswith(".json"):
        return "other-json"
    return "data"


def components_from_name(name: str) -> set[str]:
    """Components a file name promises ("model_optim_rng.pt" -> three)."""
    n = name.lower()
    kind = kind_from_name(name)
    if kind == "progress":
        return {"progress"}
    if kind != "data":
        return set()
    tokens = [t for t in _TOKEN_SPLIT.split(n) if t]
    comps: set[str] = set()
    if any(t.startswith("optim") for t in tokens):
        comps.add("optimizer")
    if any("sched" in t for t in tokens):
        comps.add("scheduler")
    if any(t.startswith("rng") for t in tokens) or "random_state" in n:
        comps.add("rng")
    if any("model" in t for t in tokens) or any(
        t in ("weights", "ema", "adapter", "params") for t in tokens
    ):
        comps.add("model")
    if n.endswith(".safetensors"):
        comps.add("model")
    return comps


def components_from_pickle(summary: PickleSummary) -> tuple[set[str], int | None, float | None, list[str], dict]:
    """Components, step, epoch, evidence and facts from the outermost keys."""
    keys = summary.top_keys
    comps: set[str] = set()
    evidence: list[str] = []
    facts: dict = {}
    step: int | None = None
    epoch: float | None = None
    if summary.top_type != "dict" or not keys:
        return comps, step, epoch, evidence, facts

    present = {k for k, v in keys.items() if v is not None}
    lowered = {k.lower() for k in present}

    def hit(names: set[str]) -> list[str]:
        return sorted(k for k in present if k.lower() in names)

    for comp, names in (
        ("model", _MODEL_KEYS),
        ("optimizer", _OPTIMIZER_KEYS),
        ("scheduler", _SCHEDULER_KEYS),
        ("rng", _RNG_KEYS),
        ("progress", _PROGRESS_KEYS),
    ):
        found = hit(names)
        if found:
            comps.add(comp)
            evidence.append(f"pickle keys {', '.join(repr(k) for k in found[:4])} -> {comp}")
    if {"state", "param_groups"} <= lowered:
        comps.add("optimizer")
        evidence.append("pickle keys 'state', 'param_groups' -> optimizer state_dict")
    if {"base_lrs", "last_epoch"} <= lowered or {"_step_count", "last_epoch"} <= lowered:
        comps.add("scheduler")
        evidence.append("pickle keys 'last_epoch', 'base_lrs' -> LR scheduler state_dict")
    if {"python", "numpy", "cpu"} <= lowered:
        comps.add("rng")
        evidence.append("pickle keys 'python', 'numpy', 'cpu' -> RNG states")
    if not comps:
        tensorish = sum(1 for v in keys.values() if v == "tensor")
        dotted = sum(1 for k in keys if "." in k)
        if tensorish and tensorish * 2 >= len(keys) or dotted * 2 > len(keys) and tensorish:
            comps.add("model")
            evidence.append(f"pickle holds a bare state_dict ({summary.top_key_count} tensors) -> model")
    # A DeepSpeed model_states file carries "optimizer": None under ZeRO.
    for k in ("optimizer", "lr_scheduler"):
        if k in keys and keys[k] is None:
            facts[f"{k}_is_none"] = True

    for k in _STEP_KEYS:
        v = keys.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            step = v
            evidence.append(f"pickle key {k!r}={v}")
            break
    for k in _EPOCH_KEYS:
        v = keys.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            epoch = v
            evidence.append(f"pickle key {k!r}={v}")
            break
    for k in ("dp_world_size", "mp_world_size"):
        v = keys.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            facts[k] = v
    if "scheduler" in comps and isinstance(keys.get("last_epoch"), int):
        facts["scheduler_steps"] = keys["last_epoch"]
    if "pytorch-lightning_version" in keys or "lightning_version" in keys:
        facts["lightning"] = True
    if "ds_version" in keys or "ds_config" in keys:
        facts["deepspeed"] = True
    return comps, step, epoch, evidence, facts


def check_file(path: str, deadline: Deadline | None = None) -> FileCheck:
    """Inspect one candidate file; never raises for bad content."""
    fc = FileCheck(path=path)
    name = os.path.basename(path)
    try:
        st = os.lstat(path)
        fc.size, fc.mtime = st.st_size, st.st_mtime
        with open_regular(path) as f:
            head = f.read(16)
            f.seek(0)
            if name.endswith(".json"):
                _check_json(f, fc, name)
            elif name == ".metadata":
                _check_dcp_metadata(f, fc, deadline)
            elif name.endswith(".distcp"):
                fc.kind = "dcp-shard"
                fc.ok = None
            elif head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
                _check_zip(f, fc, deadline)
            elif name.endswith(".safetensors"):
                _check_safetensors(f, fc)
            elif head[:1] == b"\x80":
                _check_raw_pickle(f, fc, deadline)
            elif fc.size == 0:
                fc.kind = "empty"
                fc.ok = False
                fc.problems.append("file is empty")
            else:
                fc.kind = "unknown"
                fc.ok = None
                fc.evidence.append("not a zip, pickle or safetensors file")
    except OSError as exc:
        fc.ok = False
        fc.problems.append(f"cannot read: {exc.strerror or exc}")
    return fc


def _check_json(f, fc: FileCheck, name: str) -> None:
    fc.kind = "json"
    if fc.size > _MAX_JSON_BYTES:
        fc.ok = None
        fc.evidence.append("JSON too large to read")
        return
    try:
        data = json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as exc:
        fc.ok = False
        fc.problems.append(f"JSON does not parse ({exc}); truncated?")
        return
    fc.ok = True
    if not isinstance(data, dict):
        return
    if name == "trainer_state.json":
        fc.components.add("progress")
        gs = data.get("global_step")
        if isinstance(gs, int) and not isinstance(gs, bool):
            fc.step = gs
            fc.evidence.append(f"trainer_state.json global_step={gs}")
        ep = data.get("epoch")
        if isinstance(ep, (int, float)) and not isinstance(ep, bool):
            fc.epoch = ep
            fc.evidence.append(f"trainer_state.json epoch={ep}")
        best = data.get("best_model_checkpoint")
        if isinstance(best, str):
            fc.facts["best_model_checkpoint"] = best
    elif name.endswith(".index.json"):
        wm = data.get("weight_map")
        if isinstance(wm, dict):
            fc.facts["index_files"] = sorted({v for v in wm.values() if isinstance(v, str)})
            fc.evidence.append(f"{name} names {len(fc.facts['index_files'])} shard file(s)")


def _check_dcp_metadata(f, fc: FileCheck, deadline: Deadline | None) -> None:
    fc.kind = "dcp-metadata"
    if fc.size > _MAX_PICKLE_BYTES:
        fc.ok = None
        fc.evidence.append(".metadata too large to scan")
        return
    summary = scan_pickle(f.read(), deadline)
    fc.unusual_globals = summary.unusual_globals
    if summary.error:
        fc.ok = False
        fc.problems.append(f".metadata: {summary.error}")
    else:
        fc.ok = True
    fc.facts["distcp_files"] = sorted(summary.distcp_files)
    fc.facts["extents"] = dict(summary.extents)
    fc.evidence.append(
        f".metadata names {len(summary.distcp_files)} .distcp shard(s)"
    )
    # state_dict_metadata keys are flattened names: "model.layer.weight",
    # "optimizer.state.layer.weight.exp_avg", ...
    prefixes = {p.lower() for p in summary.key_prefixes}
    if prefixes & _MODEL_KEYS:
        fc.components.add("model")
    if prefixes & _OPTIMIZER_KEYS:
        fc.components.add("optimizer")
    if prefixes & _SCHEDULER_KEYS:
        fc.components.add("scheduler")
    if fc.components:
        fc.evidence.append(
            ".metadata keys name " + ", ".join(sorted(fc.components))
        )
    else:
        fc.facts["opaque"] = True


def _check_raw_pickle(f, fc: FileCheck, deadline: Deadline | None) -> None:
    head = f.read(64)
    f.seek(0)
    # PROTO 2, LONG1 of 10 bytes: the legacy torch.save magic number.
    if head[:4] == b"\x80\x02\x8a\x0a" and (
        int.from_bytes(head[4:14], "little") == TORCH_LEGACY_MAGIC
    ):
        _check_legacy(f, fc, deadline)
        return
    if not head.startswith(b"\x80"):
        # Not a pickle (protocol 2+ always starts with PROTO): data shards,
        # tokenizer blobs and other ``.bin`` files are not checkpoints.
        fc.kind = "unknown"
        return
    fc.kind = "pickle"
    if fc.size > _MAX_PICKLE_BYTES:
        fc.ok = None
        fc.facts["opaque"] = True
        fc.evidence.append("pickle too large to scan")
        return
    data = f.read()
    summary = scan_pickle(data, deadline)
    _apply_pickle(fc, summary)
    if summary.error:
        fc.ok = False
        fc.problems.append(summary.error)
    else:
        fc.ok = True
        fc.evidence.append("pickle opcode stream reaches STOP")


#: bytes per element of the storage types a legacy torch.save file names
_STORAGE_BYTES = {
    "Double": 8, "Float": 4, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
    "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "Untyped": 1,
}


def _pickle_end(f: io.BytesIO) -> int:
    """Offset just past the pickle that starts at ``f``'s position (parsed, never run); ValueError if cut."""
    for op, _arg, _pos in pickletools.genops(f):
        if op.name == "STOP":
            return f.tell()
    raise ValueError("pickle ends before STOP")  # pragma: no cover - genops raises first


def _legacy_pickles(f, fc: FileCheck, deadline: Deadline | None) -> tuple[PickleSummary, list[str], int] | None:
    """(the object pickle's summary, the storage keys, where the storages start), or None with the verdict set.

    The five pickles are parsed from memory (at most the scan cap), so that a length field
    in a damaged file never makes a read allocate it.
    """
    head = io.BytesIO(f.read(_MAX_PICKLE_BYTES + (1 << 20)))
    try:
        for _ in range(3):  # magic number, protocol version, sys_info
            _pickle_end(head)
        start = head.tell()
        end = _pickle_end(head)
        keys = [a for op, a, _p in pickletools.genops(head) if isinstance(a, str) and op.name != "PROTO"]
    except Exception as exc:  # pickletools raises ValueError, EOFError, struct.error ... on a cut stream
        if len(head.getbuffer()) < fc.size:
            fc.ok, fc.facts["opaque"] = None, True
            fc.evidence.append("legacy torch.save pickles too large to scan")
        else:
            fc.ok = False
            fc.problems.append(f"legacy torch.save file cut off inside its pickles ({type(exc).__name__}: {exc})")
        return None
    return scan_pickle(head.getbuffer()[start:end].tobytes(), deadline), keys, head.tell()


def _check_legacy(f, fc: FileCheck, deadline: Deadline | None) -> None:
    """The legacy torch.save layout walked end to end: pickles, then every storage's count and bytes."""
    fc.kind = "torch-legacy"
    parsed = _legacy_pickles(f, fc, deadline)
    if parsed is None:
        return
    summary, keys, pos = parsed
    _apply_pickle(fc, summary)
    if summary.error:
        fc.ok = False
        fc.problems.append(f"legacy torch.save object pickle: {summary.error}")
        return
    bad: list[str] = []
    for i, key in enumerate(keys):
        if deadline is not None and i % 4096 == 0 and deadline.expired():
            fc.ok = None
            fc.problems.append("deadline reached while checking the legacy storages")
            return
        width = _STORAGE_BYTES.get(summary.storage_types.get(key, "").rpartition(".")[2][: -len("Storage")])
        f.seek(pos)
        raw = f.read(8)
        if len(raw) < 8 or width is None:
            bad.append(f"storage {key}: " + ("no element count" if len(raw) < 8 else "unknown storage type"))
            break
        count = int.from_bytes(raw, "little")
        if summary.storages.get(key) not in (None, count):
            bad.append(f"storage {key}: {count} elements, the object records {summary.storages[key]}")
        pos += 8 + count * width
        if pos > fc.size:
            bad.append(f"storage {key}: {count} elements end at byte {pos} but the file has {fc.size}; truncated")
            break
    missing = sorted(set(summary.storages) - set(keys))
    if missing:
        bad.append(f"{len(missing)} storage(s) the object names are not written (e.g. {missing[0]})")
    if not bad and pos != fc.size:
        bad.append(f"storages end at byte {pos} but the file has {fc.size}"
                   + ("; truncated" if pos > fc.size else ""))
    if bad:
        fc.ok = False
        fc.problems.append("legacy torch.save file: " + "; ".join(bad[:3]))
        return
    fc.ok = True
    fc.evidence.append(f"legacy torch.save layout whole: {len(keys)} storage(s), ends at the last one")


def _apply_pickle(fc: FileCheck, summary: PickleSummary) -> None:
    comps, step, epoch, evidence, facts = components_from_pickle(summary)
    if "num_processes" in summary.world_sizes:
        facts["num_processes"] = summary.world_sizes["num_processes"]
    fc.components |= comps
    if step is not None:
        fc.step = step
    if epoch is not None:
        fc.epoch = epoch
    fc.evidence.extend(evidence)
    fc.facts.update(facts)
    fc.facts["top_type"] = summary.top_type
    if summary.top_type != "dict":
        fc.facts["opaque"] = True
    fc.unusual_globals = summary.unusual_globals


def _check_zip(f, fc: FileCheck, deadline: Deadline | None) -> None:
    fc.kind = "zip"
    try:
        zf = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        fc.ok = False
        fc.problems.append(f"zip central directory unreadable ({exc}); file truncated?")
        return
    with zf:
        infos = zf.infolist()
        if len(infos) > _MAX_ZIP_MEMBERS:
            fc.ok = None
            fc.evidence.append(f"zip has {len(infos)} members; too many to check")
            return
        fc.evidence.append(f"zip central directory intact ({len(infos)} members)")
        bad = []
        for i, info in enumerate(infos):
            if deadline is not None and i % 256 == 0 and deadline.expired():
                fc.ok = None
                fc.problems.append("deadline reached while checking zip members")
                return
            f.seek(info.header_offset)
            local = f.read(30)
            if len(local) < 30 or local[:4] != b"PK\x03\x04":
                bad.append(f"{info.filename}: no local header at offset {info.header_offset}")
                continue
            n_name, n_extra = struct.unpack("<HH", local[26:30])
            end = info.header_offset + 30 + n_name + n_extra + info.compress_size
            if end > fc.size:
                bad.append(
                    f"{info.filename}: data ends at byte {end} but file has {fc.size}"
                )
        if bad:
            fc.ok = False
            fc.problems.append(f"{len(bad)} damaged member(s): " + "; ".join(bad[:3]))
            return
        fc.evidence.append("every member's local header and data fit in the file")

        names = {i.filename for i in infos}
        pkl = [n for n in names if n == "data.pkl" or n.endswith("/data.pkl")]
        if not pkl:
            fc.ok = True
            fc.facts["opaque"] = True
            fc.evidence.append("zip without data.pkl: not a torch.save file")
            return
        pkl_name = min(pkl, key=len)
        prefix = pkl_name[: -len("data.pkl")]
        fc.kind = "torch-zip"
        if not ({prefix + "version", prefix + ".data/version"} & names):
            fc.evidence.append("no version record (unusual for torch.save)")
        info = zf.getinfo(pkl_name)
        if info.file_size > _MAX_PICKLE_BYTES:
            fc.ok = True
            fc.facts["opaque"] = True
            fc.evidence.append("data.pkl too large to scan; components unknown")
            return
        try:
            data = zf.read(pkl_name)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            fc.ok = False
            fc.problems.append(f"data.pkl unreadable ({exc})")
            return
        summary = scan_pickle(data, deadline)
        _apply_pickle(fc, summary)
        if summary.error:
            fc.ok = False
            fc.problems.append(f"data.pkl: {summary.error}")
            return
        missing = sorted(k for k in summary.storages if prefix + "data/" + k not in names)
        if missing:
            fc.ok = False
            fc.problems.append(
                f"data.pkl references {len(missing)} tensor storage(s) missing from the zip "
                f"(e.g. data/{missing[0]})"
            )
            return
        fc.ok = True
        fc.evidence.append(
            f"data.pkl CRC ok; all {len(summary.storages)} referenced storages present"
        )


def _check_safetensors(f, fc: FileCheck) -> None:
    fc.kind = "safetensors"
    fc.components.add("model")
    raw = f.read(8)
    if len(raw) < 8:
        fc.ok = False
        fc.problems.append(f"safetensors file is {fc.size} bytes; too short for a header")
        return
    hlen = int.from_bytes(raw, "little")
    if hlen > _MAX_SAFETENSORS_HEADER or 8 + hlen > fc.size:
        fc.ok = False
        fc.problems.append(
            f"safetensors header length {hlen} does not fit in a {fc.size}-byte file"
        )
        return
    try:
        header = json.loads(f.read(hlen))
    except (ValueError, UnicodeDecodeError) as exc:
        fc.ok = False
        fc.problems.append(f"safetensors header is not valid JSON ({exc})")
        return
    if not isinstance(header, dict):
        fc.ok = False
        fc.problems.append("safetensors header is not a JSON object")
        return
    data_bytes = fc.size - 8 - hlen
    max_end = 0
    n = 0
    bad = []
    for tname, t in header.items():
        if tname == "__metadata__":
            continue
        try:
            begin, end = t["data_offsets"]
            shape = t["shape"]
            dtype = t["dtype"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            bad.append(f"{tname}: malformed entry")
            continue
        n += 1
        if end < begin:
            bad.append(f"{tname}: end before begin")
        width = _DTYPE_BYTES.get(dtype)
        if width is not None:
            count = 1
            for d in shape:
                count *= int(d)
            if count * width != end - begin:
                bad.append(f"{tname}: {dtype}{list(shape)} needs {count * width} bytes, header gives {end - begin}")
        max_end = max(max_end, end)
    if bad:
        fc.ok = False
        fc.problems.append("inconsistent safetensors header: " + "; ".join(bad[:3]))
        return
    if max_end > data_bytes:
        fc.ok = False
        fc.problems.append(
            f"safetensors header says {max_end} bytes of tensor data but the file has {data_bytes}; truncated"
        )
        return
    if max_end < data_bytes:
        fc.ok = False
        fc.problems.append(
            f"safetensors file has {data_bytes - max_end} bytes after the last tensor; not a clean write"
        )
        return
    fc.ok = True
    fc.evidence.append(
        f"safetensors header: {n} tensors, {max_end} data bytes, matches file size"
    )
