"""How the test suite's torchrun ranks end: without interpreter finalization.

PyTorch's gloo worker threads (pt_gloo_runloop) free each collective's work
when it is done, and that can drop Python objects: the autograd context that
torch.autograd.backward stashes in the thread-local state every work captures
(the allreduces DDP launches during backward), or a tensor's Python object
that the tensor kept alive. Dropping one takes the GIL. A thread that waits
for it when the interpreter begins to finalize is ended by CPython (< 3.14)
with pthread_exit, and the unwind through that noexcept destructor
(~ThreadLocalState, ~TensorImpl) is std::terminate: the rank aborts with
"terminate called without an active exception" (exit code -6), whenever
freeing a work overlaps the exit. Nothing of torch_stage is involved.

destroy_process_group() cannot rule it out: it joins those threads only when
the last reference to the group goes, and once DistributedDataParallel has
imported torch.distributed.nn.functional, that module's default arguments
(group=group.WORLD) keep the default group alive for good (torch 2.13). So
the ranks skip finalization: with no Python left to run, no thread can be
ended inside a destructor. tests/reliability/gloo_exit.py reproduces the
abort (the ddp.gloo_exit scenario).
"""

import os
import sys

from reliability.probes import settle, stage_threads

# Staging threads finish as their epoch ends; give a closing one this long.
STAGING_GONE_WITHIN_S = 1.0


def end_rank() -> None:
    """End this rank with exit status 0, after its results are saved.

    The interpreter's exit would have stopped any torch_stage staging
    thread still running (torch_stage's exit hook); skipping it, this checks
    instead that none is left: raises RuntimeError if one is.
    """
    if settle(lambda: stage_threads() == 0, STAGING_GONE_WITHIN_S) < 0:
        raise RuntimeError(
            f"{stage_threads()} torch_stage staging thread(s) still running at the end "
            f"of the rank, {STAGING_GONE_WITHIN_S} s after training: every epoch should "
            "have stopped its own"
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
