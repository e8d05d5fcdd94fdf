"""Which arguments a graph node writes, from the ATen schemas of the ops it
runs.

A node's target may be an ATen overload or packet, a ``torch.*`` builtin, a
``Tensor`` method, an ``operator`` function (Dynamo records ``h += 1`` as
``operator.iadd``) or any Python function that ends in ATen ops. Names do
not say which of them write (``add_`` does, ``_foreach_add_`` and
``_fused_adam_`` do though their names start with ``_``, ``iadd`` does
with no trailing ``_``), so the answer is taken from the ops themselves:

1. an ATen overload: its schema (``alias_info.is_write``);
2. anything else: the node is run once on meta tensors (no data, no
   device work) under a dispatch mode that records the ATen ops it reaches
   and, from their schemas, which of the meta tensors they write; those map
   back to the node's arguments. Meta tensors take the node's recorded
   shapes and dtypes when example inputs were given (``tensor_meta``), else
   one-element float tensors, which answer for every op whose writes do
   not depend on shapes; parameters and buffers (``get_attr`` nodes) take
   their own shapes, strides and dtypes when the graph's owner is given;
3. a packet or builtin the probe cannot run: the union, over the op's
   overloads, of the positions and names its schemas mark as written.

Schemas understate a few writes, written down here with a test each
(tests/streams/fx/test_fx_effects.py): batch norm's running statistics in training
(``native_batch_norm`` and ``F.batch_norm`` take them as plain inputs),
by their argument names here (:func:`understated_writes`, which the stream
sanitizer uses too) and for modules where modules are classified
(torch_stage/streams/fx/analysis.py); RNG state, which the rewrite keeps by
issuing random ops in their original order (tests/streams/test_multi_stream.py: the
``random_branches`` zoo model is bit-identical to eager).
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import threading
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch.fx.passes.shape_prop import TensorMetadata
from torch.jit._builtins import _find_builtin
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from torch_stage.streams.fx._example import attribute, storage_id, written_tensors

__all__ = [
    "aliased_args",
    "draws_random",
    "known_effects",
    "probe_cache",
    "understated_writes",
    "user_callable_args",
    "writes_module_state",
    "written_args",
]


def written_args(n: torch.fx.Node, root: Optional[torch.nn.Module] = None) -> List[Any]:
    """The values among ``n``'s arguments (nodes or lists of nodes) that
    ``n`` writes, for ``call_function`` and ``call_method`` nodes. ``root``
    owns the graph: with it, parameters and buffers (``get_attr`` nodes)
    take part in the probe, as meta tensors of their shapes."""
    if n.op not in ("call_function", "call_method"):
        return []
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        found = _by_schemas([n.target._schema], n.args, n.kwargs)
    elif n.op == "call_function" and not _probe_safe(n) and not known_effects(n, root):
        # A user's function (torch.fx.wrap) is not run at planning time and
        # no schema speaks for it: it may write any tensor it is given.
        return user_callable_args(n)
    else:
        found = _probe(n, root) if _probe_safe(n) else None
        if found is None:
            found = _by_schemas(_schemas(n), n.args, n.kwargs)
        if found == [] and _mutates_first_operand(n) and isinstance(n.args[0], torch.fx.Node):
            found = [n.args[0]]
    for value in _running_stats(n):
        if not any(value is f for f in found):
            found.append(value)
    return found


def user_callable_args(n: torch.fx.Node) -> List[torch.fx.Node]:
    """The nodes among ``n``'s arguments, keyword arguments and their
    lists: what a user's function or leaf module, whose effects nothing at
    planning time can tell, is taken to write."""
    found: List[torch.fx.Node] = []
    for value in tree_flatten((n.args, n.kwargs))[0]:
        if isinstance(value, torch.fx.Node) and value not in found:
            found.append(value)
    return found


def aliased_args(n: torch.fx.Node, root: Optional[torch.nn.Module] = None) -> List[torch.fx.Node]:
    """The argument nodes whose memory ``n``'s result may share, from the op
    itself: an ATen overload's schema (a return annotated with an argument's
    alias set, ``Tensor(a)``); anything else of torch's, run on meta
    stand-ins (``contiguous``, ``.float()`` and ``.to`` of a tensor already
    so return it; so do eval-mode dropout, ``.data`` and ``nn.Flatten``);
    failing that, the alias sets of the op's schemas. A name list of views
    misses every op that may return its input. ``root`` owns the graph
    (for ``call_module`` nodes: modules from ``torch.nn`` are probed with
    meta parameters; ``get_attr`` nodes: ``self.a.weight.data`` is probed
    with a meta stand-in of the weight)."""
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        return _aliased_by_schemas([n.target._schema], n.args, n.kwargs)
    if n.op == "call_module":
        module = _torch_nn_module(n, root)
        if module is None:
            return []
        probed = _probe_both(n, module, root)
        return [] if probed is None else probed[1]
    if n.op not in ("call_function", "call_method"):
        return []
    probed = _probe_both(n, root=root) if _probe_safe(n) else None
    if probed is not None:
        return probed[1]
    return _aliased_by_schemas(_schemas(n), n.args, n.kwargs)


def writes_module_state(n: torch.fx.Node, root: torch.nn.Module) -> Optional[bool]:
    """Whether the ``call_module`` node ``n`` writes its module's own
    parameters or buffers, which are no node of the graph: batch norm's
    running statistics in training, an embedding's rows renormalised in
    place with ``max_norm``. From a run on meta stand-ins, for modules from
    ``torch.nn``; None where that cannot tell: a user's module (not run at
    planning time), or one that does not run on stand-ins of unknown shapes
    (without example inputs: a linear layer under spectral norm)."""
    if n.op != "call_module":
        return False
    module = _torch_nn_module(n, root)
    if module is None:
        return None
    probed = _probe_both(n, module, root)
    return None if probed is None else probed[2]


def _torch_nn_module(n: torch.fx.Node, root: Optional[torch.nn.Module]):
    """The module a ``call_module`` node calls, where it is one of
    ``torch.nn``'s (whose effects its ops tell: it may run on meta
    stand-ins); None for a user's module, or without ``root``."""
    if root is None:
        return None
    module = root.get_submodule(n.target)
    return module if type(module).__module__.startswith("torch.nn.") else None


def draws_random(n: torch.fx.Node, root: Optional[torch.nn.Module] = None) -> bool:
    """Whether ``n`` may draw from a random generator (its values then
    depend on when it is issued among the others that do), from the ops:
    an ATen op tagged ``nondeterministic_seeded`` (``randn_like``,
    ``bernoulli_``, ``native_dropout``); anything else of torch's, such as
    ``F.dropout`` or ``nn.Dropout``, is run on meta stand-ins and asked the
    same of every op it reaches; failing that, the ops its schemas name.
    True where none of these can tell."""
    if n.op not in ("call_function", "call_method", "call_module"):
        return False
    target = n.target
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(
            torch.Tag.nondeterministic_seeded in getattr(target, o).tags for o in target.overloads()
        )
    probed = None
    if n.op == "call_module":
        module = _torch_nn_module(n, root)
        if module is not None:
            probed = _probe_both(n, module, root)
    elif _probe_safe(n):
        probed = _probe_both(n, root=root)
    if probed is not None:
        return probed[3]
    if n.op == "call_module":
        return True
    packets = []
    for schema in _schemas(n):
        namespace, _, name = schema.name.partition("::")
        packet = getattr(getattr(torch.ops, namespace, None), name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket) and packet not in packets:
            packets.append(packet)
    if not packets:
        return True
    return any(
        torch.Tag.nondeterministic_seeded in getattr(p, o).tags
        for p in packets
        for o in p.overloads()
    )


#: Tensor methods with no ATen schema of their name that only convert or
#: read (``x.float()``, ``x.tolist()``).
_PLAIN_METHODS = frozenset(
    ["float", "double", "half", "bfloat16", "int", "long", "short", "char", "byte", "bool",
     "type", "tolist", "__setitem__"]
)  # fmt: skip
#: Tensor methods with schemas whose effect is on autograd's or the
#: allocator's state, which no schema argument says.
_STATEFUL_METHODS = frozenset(
    ["backward", "retain_grad", "requires_grad_", "record_stream", "register_hook",
     "register_post_accumulate_grad_hook"]
)  # fmt: skip


def known_effects(n: torch.fx.Node, root: Optional[torch.nn.Module] = None) -> bool:
    """Whether all ``n`` does is what its ops' schemas and this module say
    (its writes, its aliases, its random draws), so that it can be issued
    at another point among nodes it does not depend on: ATen and prims ops;
    torch functions bound to an ATen op and those of
    ``torch.nn.functional``; Python's operators; tensor methods with an
    ATen schema (or that convert); modules of ``torch.nn``. Not the ops
    FX keeps for their side effects (asserts, profiler ranges, grad mode
    and autocast switches), nor a user's function or module."""
    op = n.op
    if op in ("placeholder", "get_attr", "output"):
        return True
    target = n.target
    if op == "call_module":
        return _torch_nn_module(n, root) is not None
    if op == "call_method":
        if target in _STATEFUL_METHODS:
            return False
        return target in _PLAIN_METHODS or bool(_schemas(n))
    if op != "call_function":
        return False
    if target is getattr:
        return True
    module = getattr(target, "__module__", None) or ""
    if module in ("_operator", "operator"):
        return True
    if target in getattr(torch.fx.node, "_side_effectful_functions", ()):
        return False
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[0] in ("aten", "prims")
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[0] in ("aten", "prims")
    if module == "torch.nn.functional":
        return True
    return (_find_builtin(target) or "").startswith("aten::")


def _aliased_by_schemas(schemas: Sequence[Any], args: tuple, kwargs: dict) -> List[Any]:
    found: List[Any] = []
    for schema in schemas:
        sets = set()
        for ret in schema.returns:
            if ret.alias_info is not None:
                sets |= set(ret.alias_info.before_set)
        if not sets:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not (set(arg.alias_info.before_set) & sets):
                continue
            value = args[i] if not arg.kwarg_only and i < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node) and value not in found:
                found.append(value)
    return found


#: Arguments whose writes schemas leave out (see the module doc).
_RUNNING_STATS = ("running_mean", "running_var")


def understated_writes(arguments: Dict[str, Any]) -> List[Any]:
    """The values among a call's ``arguments`` (name -> value) that it writes
    although its schema does not say so: batch norm's running statistics,
    when ``training`` is true.

    ``native_batch_norm`` and ``F.batch_norm`` take them as plain inputs and
    update them in place in training. The rule is on the argument names,
    which every batch-norm spelling shares (ATen schemas and the Python
    functions alike), not on op names. The stream sanitizer applies it to
    every ATen op it sees (torch_stage/streams/sanitizer.py).
    """
    if arguments.get("training") is not True:
        return []
    return [arguments[a] for a in _RUNNING_STATS if arguments.get(a) is not None]


def _running_stats(n: torch.fx.Node) -> List[Any]:
    bound = _bind(n)
    if not bound:
        return []
    return [v for v in understated_writes(bound) if isinstance(v, torch.fx.Node)]


def _bind(n: torch.fx.Node) -> Optional[Dict[str, Any]]:
    """``n``'s arguments by name, from its Python signature or its schemas."""
    if isinstance(n.target, torch._ops.OpOverload):
        schemas = [n.target._schema]
    elif n.op == "call_function":
        try:
            signature = inspect.signature(n.target)
            return dict(signature.bind(*n.args, **n.kwargs).arguments)
        except (TypeError, ValueError):
            schemas = _schemas(n)
    else:
        schemas = _schemas(n)
    for schema in schemas:
        names = [a.name for a in schema.arguments]
        if not set(_RUNNING_STATS) <= set(names) or "training" not in names:
            continue
        values = dict(zip(names, n.args))
        values.update(n.kwargs)
        return values
    return None


# Python's own in-place operators (a[b] = c, del a[b], a += b, ...): the
# language defines each to mutate its first operand, so on a tensor they
# write it, whatever ATen ops do the work. The probe answers them where it
# can run them; where it cannot, and no schema speaks for a Python
# function, this does: a setitem whose index has more dimensions than a
# one-element stand-in (w[:, 4:] = 0) failed the probe and was taken to
# write nothing, so a mask built that way was copied onto each stream
# before the write.
_IN_PLACE_OPERATORS = frozenset(
    [operator.setitem, operator.delitem]
    + [
        getattr(operator, "i" + name)
        for name in (
            "add", "and", "concat", "floordiv", "lshift", "mod", "mul", "matmul", "or",
            "pow", "rshift", "sub", "truediv", "xor",
        )
    ]
)  # fmt: skip
_IN_PLACE_METHODS = frozenset(f"__{op.__name__}__" for op in _IN_PLACE_OPERATORS)


def _mutates_first_operand(n: torch.fx.Node) -> bool:
    if not n.args:
        return False
    if n.op == "call_method":
        return n.target in _IN_PLACE_METHODS
    return n.target in _IN_PLACE_OPERATORS


def _probe_safe(n: torch.fx.Node) -> bool:
    # Only torch's own callables run on the probe: a user's leaf function
    # may have side effects that must not happen at planning time.
    if n.op == "call_method" or n.target is getattr:
        # (getattr: an attribute of a stand-in, such as .data or .T.)
        return True
    module = getattr(n.target, "__module__", None) or ""
    return module in ("_operator", "operator") or module.split(".")[0] == "torch"


def _schemas(n: torch.fx.Node) -> List[Any]:
    target = n.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        return [getattr(target, o)._schema for o in target.overloads()]
    if n.op == "call_method":
        name = f"aten::{target}"
    else:
        name = _find_builtin(target)
    if not name:
        return []
    try:
        return list(torch._C._jit_get_schemas_for_operator(name))
    except RuntimeError:
        return []


def _by_schemas(schemas: Sequence[Any], args: tuple, kwargs: dict) -> List[Any]:
    found: List[Any] = []
    for schema in schemas:
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            if not arg.kwarg_only and i < len(args):
                found.append(args[i])
            elif arg.name in kwargs:
                found.append(kwargs[arg.name])
    unique: List[Any] = []
    for value in found:
        if not any(value is u for u in unique):
            unique.append(value)
    return unique


class _WriteRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.written: List[torch.Tensor] = []
        self.seeded = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.written.extend(written_tensors(func, args, kwargs))
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seeded = True
        return func(*args, **kwargs)


def reads_metadata_only(n: torch.fx.Node) -> bool:
    """Whether ``n`` is an ATen op that reads only its inputs' metadata
    (sizes, strides, numel: ``aten.sym_size.int`` in graphs from
    torch.export) and so is host work, never a device kernel.

    From the op itself, not its name: its schema returns no tensor and
    writes nothing, it is not tagged ``data_dependent_output``, and it runs
    on meta stand-ins of its inputs (which hold no data, so an op that reads
    data, ``is_nonzero`` say, raises there). Anything unsure is device work.
    """
    op = n.target
    if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
        return False
    schema = op._schema
    if torch.Tag.data_dependent_output in op.tags or schema.is_mutable:
        return False
    for ret in schema.returns:
        if "Tensor" in str(ret.type):
            return False
    return _probe(n) == []


def _meta_for(node: torch.fx.Node, dtype: Optional[torch.dtype] = None) -> Optional[Any]:
    meta = node.meta.get("tensor_meta")
    if meta is None:
        return torch.empty(1, dtype=dtype, device="meta")
    # TensorMetadata is a NamedTuple: tested before the tuple of several.
    if not isinstance(meta, TensorMetadata):
        return None  # several outputs: the probe would need their structure
    try:
        return torch.empty(tuple(meta.shape), dtype=meta.dtype, device="meta")
    except (AttributeError, TypeError, RuntimeError):
        return None


def _probe(n: torch.fx.Node, root: Optional[torch.nn.Module] = None) -> Optional[List[Any]]:
    """Run ``n`` on meta tensors and map the written ones to its args."""
    probed = _probe_both(n, root=root)
    return None if probed is None else probed[0]


def _probe_both(
    n: torch.fx.Node,
    module: Optional[torch.nn.Module] = None,
    root: Optional[torch.nn.Module] = None,
) -> Optional[Tuple[List[Any], List[torch.fx.Node], bool, bool]]:
    """Run ``n`` (a call of ``module`` for a ``call_module`` node) on meta
    tensors: the arguments it writes, the argument nodes whose memory its
    result shares, whether it writes the module's own parameters or
    buffers, and whether it draws random numbers (an op it reaches is
    tagged ``nondeterministic_seeded``). None when it cannot run there.
    ``root`` (the graph's owner) gives the ``get_attr`` nodes among the
    arguments their stand-ins; without it, a node that reads one is not
    probed."""
    probes = getattr(_cache, "probes", None)
    key = (n, module is not None, None if root is None else id(root))
    if probes is not None and key in probes:
        return probes[key]
    probed = _probe_with(n, module, None, root)
    if probed is None and n.op == "call_module":
        # A module of indices (an embedding's lookup) takes integer ones.
        probed = _probe_with(n, module, torch.long, root)
    if probes is not None:
        probes[key] = probed
    return probed


_cache = threading.local()


@contextlib.contextmanager
def probe_cache() -> Iterator[None]:
    """Within it, this thread probes each node once (an analysis asks
    several questions of one node; the answers hold only while the graph
    and its modules do not change, so the cache ends with the context)."""
    previous = getattr(_cache, "probes", None)
    _cache.probes = {} if previous is None else previous
    try:
        yield
    finally:
        _cache.probes = previous


def _storages(values) -> set:
    """The storages of the tensors among ``values``. A tensor without one
    (a subclass's wrapper) cannot be one of the stand-ins, which are plain
    meta tensors, so it is left out."""
    keys = {storage_id(t) for t in values if isinstance(t, torch.Tensor)}
    keys.discard(None)
    return keys


def _attribute_stand_in(root: Optional[torch.nn.Module], target: str) -> Optional[torch.Tensor]:
    """A meta tensor with the shape, strides and dtype of ``root``'s
    attribute ``target`` (a ``get_attr`` node's), or None where that is no
    plain tensor or parameter (a subclass, a script object, a module)."""
    if root is None:
        return None
    try:
        value = attribute(root, target)
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            return None
        return torch.empty_strided(
            tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="meta"
        )
    except (AttributeError, RuntimeError, TypeError, NotImplementedError):
        return None


def _probe_with(
    n: torch.fx.Node,
    module: Optional[torch.nn.Module],
    dtype: Optional[torch.dtype],
    root: Optional[torch.nn.Module] = None,
) -> Optional[Tuple[List[Any], List[torch.fx.Node], bool, bool]]:
    """_probe_both with stand-ins of ``dtype`` where shapes are unknown."""
    stand_ins: Dict[torch.fx.Node, torch.Tensor] = {}
    failed = False

    def stand_in(value):
        nonlocal failed
        if not isinstance(value, torch.fx.Node):
            return value
        if value not in stand_ins:
            if value.op == "get_attr":
                t = _attribute_stand_in(root, value.target)
            elif "val" in value.meta and not isinstance(value.meta.get("val"), torch.Tensor):
                t = None
            else:
                t = _meta_for(value, dtype)
            if t is None:
                failed = True
                return value
            stand_ins[value] = t
        return stand_ins[value]

    args = tree_map(stand_in, n.args)
    kwargs = tree_map(stand_in, n.kwargs)
    if failed or not stand_ins:
        return None
    recorder = _WriteRecorder()
    module_state: Dict[str, torch.Tensor] = {}
    try:
        # What an op says of stand-ins (a dict input's stand-in indexed by
        # a key: "non-tuple sequence for multidimensional indexing") is not
        # about the user's run; it printed while planning.
        with recorder, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if n.op == "call_method":
                result = getattr(args[0], n.target)(*args[1:], **kwargs)
            elif n.op == "call_module":
                # Its parameters and buffers as meta tensors too: nothing of
                # the real module is touched.
                module_state = {
                    k: torch.empty_like(v, device="meta")
                    for k, v in [*module.named_parameters(), *module.named_buffers()]
                }
                result = torch.func.functional_call(module, module_state, args, kwargs)
            else:
                result = n.target(*args, **kwargs)
    except Exception:  # noqa: BLE001  any failure means: ask the schemas
        return None
    written_storages = _storages(recorder.written)

    def is_written(node: torch.fx.Node) -> bool:
        t = stand_ins.get(node)
        return t is not None and t.untyped_storage()._cdata in written_storages

    found: List[Any] = []
    for value in tree_flatten((n.args, n.kwargs))[0]:
        if isinstance(value, torch.fx.Node) and is_written(value) and value not in found:
            found.append(value)
    out_storages = _storages(tree_flatten(result)[0])
    aliased = [node for node, t in stand_ins.items() if t.untyped_storage()._cdata in out_storages]
    state_written = any(
        t.untyped_storage()._cdata in written_storages for t in module_state.values()
    )
    return found, aliased, state_written, recorder.seeded
