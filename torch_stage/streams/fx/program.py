"""Running a compiled stream program op by op: the ``"aot_eager"`` executor.

AOTAutograd turns the graph :class:`~torch_stage.streams.fx.user_streams.
UserStreamWriter` wrote into a forward and a backward graph of ATen ops,
each node annotated with its stream, the syncs (``torch.ops.streams.*``)
wrapped in ``control_deps`` so nothing moves across them. inductor compiles
those graphs; :func:`compile_program` instead runs them as they are, node by
node on each node's stream. That is the program inductor gets, minus its
kernels: when the compiled model is wrong, run this one to tell the plan
from the compiler; and every op goes through the dispatcher, so the stream
sanitizer (:func:`torch_stage.sanitize_streams`) sees all of it, which it
cannot in inductor's kernels.

On a device without streams (the CPU) nothing switches streams and the
event ops are not called (the CPU has no events); with a stream sanitizer
active, it models them all, as it models torch_stage's own stream ops there.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx

from torch_stage.streams import sanitizer as _sanitizer
from torch_stage.streams.fx.user_streams import has_streams, stream_index

__all__ = ["compile_program"]


def _is_control_deps(target: Any) -> bool:
    from torch._inductor.fx_passes.control_dependencies import control_deps

    return target is control_deps


class _State:
    """One run of a program (forward or backward) on one thread."""

    def __init__(self, names: Dict[int, Tuple[Any, ...]], device: torch.device):
        from torch._dynamo.graph_bytecode_inputs import get_external_object_by_index

        self.lookup = get_external_object_by_index
        self.names = names
        self.real = has_streams(device)
        self.sanitizer = _sanitizer._active_sanitizer()
        self.base = self.sanitizer._program_base() if self.sanitizer is not None else "default"
        self.entry_stream = torch.accelerator.current_stream(device) if self.real else None
        self.stream: Optional[int] = None  # the index now current (None: the caller's)

    def logical(self, index: Optional[int]) -> str:
        entry = self.names.get(index, ("current",)) if index is not None else ("current",)
        if entry[0] == "stream":
            return f"pool{entry[1]}"
        if entry[0] == "current":
            return self.base
        return f"dynamo{index}"

    def switch(self, index: Optional[int], node: str) -> None:
        if self.sanitizer is not None:
            self.sanitizer._program_at(self.logical(index), node)
        if index == self.stream:
            return
        self.stream = index
        if self.real:
            target = self.entry_stream if index is None else self.lookup(index)
            torch.accelerator.set_stream(target)

    def finish(self) -> None:
        if self.sanitizer is not None:
            self.sanitizer._program_at(None, None)
        if self.real and self.stream is not None:
            torch.accelerator.set_stream(self.entry_stream)
        self.stream = None


class _Program(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, state: _State):
        super().__init__(gm, garbage_collect_values=True)
        self.state = state

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        self.state.switch(stream_index(n), n.name)
        if _is_control_deps(n.target):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            subgraph = args[1]
            return _Program(subgraph, self.state).run(*args[2:], **kwargs)
        namespace = getattr(n.target, "namespace", None)
        if namespace == "streams":
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return self._stream_op(n, args)
        return super().run_node(n)

    def _stream_op(self, n: torch.fx.Node, args: Sequence[Any]) -> Any:
        state = self.state
        name = n.target._schema.name.split("::")[-1]
        san = state.sanitizer
        if san is not None:
            # An event is its side-table index (one object per thread, as
            # the compiled code's): recorded anew, it means the new record.
            if name == "record_event":
                san._program_record(args[0], state.logical(args[1]))
            elif name in ("wait_event", "sync_dealloc"):
                san._program_wait(args[0], state.logical(args[1]))
            elif name == "record_stream":
                san._program_keep(args[0], state.logical(args[1]))
            elif name == "wait_stream":
                san._program_wait_stream(state.logical(args[0]), state.logical(args[1]))
            elif name.startswith("synchronize"):
                san._program_host_sync()
        if state.real:
            return n.target(*args)
        return None


def compile_program(
    names: Dict[int, Tuple[Any, ...]], device: torch.device
) -> Callable[[torch.fx.GraphModule, Sequence[Any]], Callable]:
    """An AOTAutograd compiler (forward or backward) that runs the graph op
    by op on its streams (see the module doc). ``names``: what each side
    table index holds (:attr:`SideTable.entries`)."""

    def compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        def run(args: List[Any]) -> Any:
            state = _State(names, device)
            try:
                return _Program(gm, state).run(*args)
            finally:
                state.finish()

        # AOTAutograd's calling convention: one list, which the callee may
        # clear (boxed), so inputs die as soon as they are used.
        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return compiler
