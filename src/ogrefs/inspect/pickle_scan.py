"""Read what a pickle *says* without running it.

Checkpoints written by ``torch.save`` are pickles, and loading a pickle
runs whatever callables it names.  ogrefs inspects other people's boxes,
so it never unpickles.  Instead this module walks the opcode stream with
:func:`pickletools.genops` (a pure parser) and simulates only the *shape*
of the unpickler's stack: which values are strings or numbers, which are
containers, and which container a ``SETITEM(S)`` writes into.  No object
is ever constructed and no global is ever resolved.

That is enough to learn, for the outermost object of the pickle:

* its string keys and the scalar values stored under them
  (``{'epoch': 3, 'global_step': 1200, 'optimizer_states': [...]}``);
* the tensor storages it references through persistent ids
  (``('storage', <type>, '<key>', '<location>', <numel>)``), so a torch
  zip can be checked for every ``data/<key>`` member it needs;
* the globals it names, so that a file naming one outside torch's
  ``weights_only`` allowlist (and the frameworks' own classes) is known to be
  refused by ``torch.load(weights_only=True)`` and to run code otherwise;
* the world sizes recorded at any depth (``num_processes`` inside the
  accelerate state that HF's ``training_args.bin`` carries);
* ``(relative_path, offset, length)`` records built by ``BUILD`` (used by
  ``torch.distributed.checkpoint`` ``.metadata`` files) and ``*.distcp``
  file names mentioned anywhere.
"""

from __future__ import annotations

import pickletools
import re
from dataclasses import dataclass, field

from ogrefs.inspect.deadline import Deadline

__all__ = ["PickleSummary", "scan_pickle", "SAFE_GLOBAL_PREFIXES", "is_safe_global"]

#: Globals that ordinary torch / numpy / Lightning / HF checkpoints name outside torch's
#: own: the frameworks load these files with their classes allowed
#: (``torch.serialization.add_safe_globals``, HF's numpy allowlist) or write them for
#: themselves (``training_args.bin``).  Anything else is in :attr:`PickleSummary.unusual_globals`.
SAFE_GLOBAL_PREFIXES = (
    "collections.OrderedDict",
    "collections.Counter",
    "collections.defaultdict",
    "numpy.",
    "_codecs.encode",
    "builtins.set",
    "builtins.frozenset",
    "builtins.slice",
    "builtins.complex",
    "builtins.bytearray",
    "builtins.int",
    "builtins.float",
    "copyreg._reconstructor",
    "copyreg.__newobj__",
    "__builtin__.set",
    "argparse.Namespace",
    "pytorch_lightning.",
    "lightning.",
    "lightning_fabric.",
    "transformers.",
    "accelerate.",
    "deepspeed.",
    "omegaconf.",
    "pathlib.",
    "datetime.",
    "enum.",
    "typing.",
)
#: The torch globals of torch.load(weights_only=True)'s allowlist (tensor and storage
#: rebuilders, storage types, dtypes, layouts, Size, device) and of DCP's metadata.
#: A bare "torch." prefix would let ``torch.hub.load`` or ``torch.utils.cpp_extension``
#: through.
_TORCH_SAFE = re.compile(
    r"^torch\.(?:_utils\._rebuild_\w+|_tensor\._rebuild_from_type(?:_v2)?|Tensor|nn\.parameter\.\w+"
    r"|storage\.(?:Typed|Untyped)Storage|serialization\._get_layout|distributed\.\w+(?:\.\w+)*"
    r"|torch_version\.TorchVersion|_C\._nn\.gelu|[A-Z]\w*Storage|Size|device|dtype|layout|memory_format"
    r"|float\d*|bfloat16|half|double|u?int\d*|long|short|bool|complex\d*|cfloat|cdouble|q?u?int\d+x?\d*"
    r"|float8_\w+|strided|sparse_\w+|_mkldnn|contiguous_format|channels_last\w*|preserve_format)$"
)


def is_safe_global(name: str) -> bool:
    """Would torch.load with the frameworks' allowlists accept this global without running arbitrary code?"""
    if name.startswith("torch."):
        return bool(_TORCH_SAFE.match(name))
    return name.startswith(SAFE_GLOBAL_PREFIXES)


_WORLD_KEYS = frozenset({"num_processes", "world_size", "dp_world_size"})
_MAX_TOP_KEYS = 2000
_MAX_SMALL_DICT = 16
_MAX_STR = 256
_MAX_PREFIXES = 1000
_DEADLINE_EVERY = 4096


class _Mark:
    __slots__ = ()


_MARK = _Mark()


class _Dict:
    """A dict under construction; keeps a few scalar items (for BUILD)."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: dict[str, object] = {}


@dataclass
class PickleSummary:
    """What the opcode scan learned.  Every field is plain data."""

    #: key -> scalar value (str/int/float/bool/None) or a type word
    #: ("dict", "list", "tuple", "object", "tensor", ...), for the outermost
    #: object when it is a mapping.
    top_keys: dict[str, object] = field(default_factory=dict)
    top_key_count: int = 0
    top_type: str = "unknown"
    storages: dict[str, int | None] = field(default_factory=dict)
    globals: set[str] = field(default_factory=set)
    distcp_files: set[str] = field(default_factory=set)
    #: relative_path -> largest offset+length seen in BUILD records
    extents: dict[str, int] = field(default_factory=dict)
    #: first dotted segment of every string key set into any dict
    #: ("model" for "model.layer.weight"); DCP metadata keys look like that
    key_prefixes: set[str] = field(default_factory=set)
    #: world sizes recorded at any depth (``num_processes`` in the accelerate state that HF's
    #: ``training_args.bin`` carries, ``dp_world_size``): key -> first integer seen
    world_sizes: dict[str, int] = field(default_factory=dict)
    #: persistent-id storage key -> its storage type's global ("torch.FloatStorage")
    storage_types: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    truncated: bool = False

    @property
    def unusual_globals(self) -> list[str]:
        return sorted(g for g in self.globals if not is_safe_global(g))


_STR_OPS = {
    "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
    "SHORT_BINUNICODE", "BINUNICODE8",
}
_INT_OPS = {"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"}
_FLOAT_OPS = {"FLOAT", "BINFLOAT"}
_PUT_OPS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GET_OPS = {"GET", "BINGET", "LONG_BINGET"}
_TUPLE_N = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}


def _scalar(tag: object) -> object:
    """The JSON-able meaning of a stack tag."""
    if isinstance(tag, tuple) and tag and tag[0] == "v":
        return tag[1]
    if isinstance(tag, _Dict):
        return "dict"
    if isinstance(tag, tuple) and tag and tag[0] == "tuple":
        return "tuple"
    if isinstance(tag, str):
        return tag
    return "object"


def _value(v: object) -> tuple:
    if isinstance(v, str) and len(v) > _MAX_STR:
        v = v[:_MAX_STR]
    return ("v", v)


def scan_pickle(data: bytes, deadline: Deadline | None = None) -> PickleSummary:
    """Summarise a pickle's opcode stream.  Never executes anything.

    Malformed or truncated input is reported in ``error``; whatever was
    learned before the fault is kept.
    """
    out = PickleSummary()
    stack: list[object] = []
    memo: dict[int, object] = {}

    def pop_to_mark() -> list[object]:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is _MARK:
                items = stack[i + 1:]
                del stack[i:]
                return items
        raise IndexError("no MARK on the stack")

    def set_items(target_index: int, pairs: list[object]) -> None:
        target = stack[target_index]
        for k, v in zip(pairs[0::2], pairs[1::2]):
            key = _scalar(k)
            if target_index == 0:
                out.top_key_count += 1
                if isinstance(key, str) and len(out.top_keys) < _MAX_TOP_KEYS:
                    out.top_keys[key] = _scalar(v)
            if isinstance(key, str) and len(out.key_prefixes) < _MAX_PREFIXES:
                out.key_prefixes.add(key.split(".", 1)[0])
            if key in _WORLD_KEYS and isinstance(v, tuple) and v[0] == "v" and type(v[1]) is int:
                out.world_sizes.setdefault(key, v[1])
            if isinstance(target, _Dict) and isinstance(key, str):
                if len(target.items) < _MAX_SMALL_DICT:
                    target.items[key] = _scalar(v)

    def note_build(state: object) -> None:
        # dataclass state: a dict, or (None, slots-dict) for __slots__ classes
        if isinstance(state, tuple) and state[0] == "tuple":
            parts = state[1]
            state = next((p for p in parts if isinstance(p, _Dict)), None)
        if not isinstance(state, _Dict):
            return
        items = state.items
        path, off, length = (
            items.get("relative_path"), items.get("offset"), items.get("length"),
        )
        if isinstance(path, str) and isinstance(off, int) and isinstance(length, int):
            end = off + length
            if end > out.extents.get(path, -1):
                out.extents[path] = end

    try:
        for n, (op, arg, _pos) in enumerate(pickletools.genops(data)):
            if deadline is not None and n % _DEADLINE_EVERY == 0 and deadline.expired():
                out.truncated = True
                out.error = "deadline reached while scanning the pickle"
                break
            name = op.name
            if name == "STOP":
                break
            if name in ("PROTO", "FRAME"):
                continue
            if name == "MARK":
                stack.append(_MARK)
            elif name in _STR_OPS:
                if isinstance(arg, bytes):
                    arg = arg.decode("latin-1")
                if arg.endswith(".distcp"):
                    out.distcp_files.add(arg)
                stack.append(_value(arg))
            elif name in _INT_OPS:
                stack.append(_value(arg))
            elif name in _FLOAT_OPS:
                stack.append(_value(arg))
            elif name == "NEWTRUE":
                stack.append(_value(True))
            elif name == "NEWFALSE":
                stack.append(_value(False))
            elif name == "NONE":
                stack.append(_value(None))
            elif name in ("EMPTY_DICT", "DICT"):
                d = _Dict()
                if name == "DICT":
                    items = pop_to_mark()
                    stack.append(d)
                    set_items(len(stack) - 1, items)
                else:
                    stack.append(d)
            elif name in ("EMPTY_LIST", "LIST"):
                if name == "LIST":
                    pop_to_mark()
                stack.append("list")
            elif name == "EMPTY_SET":
                stack.append("set")
            elif name == "EMPTY_TUPLE":
                stack.append(("tuple", []))
            elif name == "TUPLE":
                stack.append(("tuple", pop_to_mark()))
            elif name in _TUPLE_N:
                k = _TUPLE_N[name]
                items = stack[-k:]
                if len(items) != k:
                    raise IndexError("stack underflow")
                del stack[-k:]
                stack.append(("tuple", items))
            elif name in _PUT_OPS:
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in _GET_OPS:
                stack.append(memo.get(arg, "object"))
            elif name == "GLOBAL":
                g = arg.replace(" ", ".", 1) if isinstance(arg, str) else str(arg)
                out.globals.add(g)
                stack.append(("global", g))
            elif name == "STACK_GLOBAL":
                qual, mod = stack.pop(), stack.pop()
                g = f"{_scalar(mod)}.{_scalar(qual)}"
                out.globals.add(g)
                stack.append(("global", g))
            elif name == "SETITEM":
                v, k = stack.pop(), stack.pop()
                set_items(len(stack) - 1, [k, v])
            elif name == "SETITEMS":
                items = pop_to_mark()
                set_items(len(stack) - 1, items)
            elif name in ("APPEND",):
                stack.pop()
            elif name in ("APPENDS", "ADDITEMS"):
                pop_to_mark()
            elif name == "BUILD":
                note_build(stack.pop())
                if not stack:
                    raise IndexError("stack underflow")
            elif name == "BINPERSID":
                pid = stack.pop()
                if isinstance(pid, tuple) and pid[0] == "tuple":
                    parts = [_scalar(p) for p in pid[1]]
                    if len(parts) >= 3 and parts[0] == "storage" and isinstance(parts[2], str):
                        numel = parts[4] if len(parts) > 4 and isinstance(parts[4], int) else None
                        out.storages[parts[2]] = numel
                        kind = pid[1][1]
                        if isinstance(kind, tuple) and kind[0] == "global":
                            out.storage_types[parts[2]] = kind[1]
                stack.append("tensor")
            elif name == "REDUCE":
                _args, func = stack.pop(), stack.pop()
                if isinstance(func, tuple) and func[0] == "global" and "rebuild" in func[1]:
                    stack.append("tensor" if "tensor" in func[1] or "parameter" in func[1] else "object")
                elif isinstance(func, tuple) and func[0] == "global" and func[1].endswith("OrderedDict"):
                    stack.append(_Dict())
                else:
                    stack.append("object")
            elif name == "DUP":
                stack.append(stack[-1])
            elif name == "POP":
                stack.pop()
            elif name == "POP_MARK":
                pop_to_mark()
            else:
                # Generic stack effect from pickletools' own opcode table.
                before, after = op.stack_before, op.stack_after
                if pickletools.markobject in before:
                    pop_to_mark()
                    below = before[: before.index(pickletools.markobject)]
                else:
                    below = before
                for _ in below:
                    stack.pop()
                stack.extend("object" for _ in after)
    except (ValueError, IndexError, KeyError, TypeError, AttributeError) as exc:
        out.error = f"malformed pickle: {exc}"
    except Exception as exc:  # pickletools raises a few odd types on junk
        out.error = f"malformed pickle: {type(exc).__name__}: {exc}"
    if out.error and len(stack) > 2 and isinstance(stack[0], _Dict) and stack[1] is _MARK:
        # Cut off mid-dict: keep the complete key/value pairs pushed so far.
        pending = []
        for item in stack[2:]:
            if item is _MARK:
                break
            pending.append(item)
        set_items(0, pending[: len(pending) // 2 * 2])
    if stack and stack[0] is not _MARK:
        root = stack[0]
        if isinstance(root, _Dict):
            out.top_type = "dict"
        else:
            word = _scalar(root)
            out.top_type = word if isinstance(word, str) and word in ("list", "tensor", "tuple", "set") else "object"
    return out
