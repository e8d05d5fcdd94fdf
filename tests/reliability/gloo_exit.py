"""A 2-rank torchrun job whose rank 1 ends while PyTorch's gloo worker thread
waits for the GIL to free a finished allreduce (the ddp.gloo_exit scenario):

    PYTHONPATH=.:tests python -m torch.distributed.run --standalone \\
        --nproc_per_node 2 tests/reliability/gloo_exit.py [return]

Rank 1 launches an allreduce from inside backward, as DDP's reducer does: the
work captures the thread-local state, which holds the autograd context that
torch.autograd.backward stashes there, a Python object. The gloo worker thread
(pt_gloo_runloop) frees the work once it is done, so it takes the GIL to drop
that object. Rank 1's last exit handlers let rank 0 join the allreduce and then
keep the GIL, in C, until that thread waits for it; the interpreter then begins
to finalize, and CPython (< 3.14) ends the waiting thread with pthread_exit,
whose unwind through the noexcept destructor is std::terminate: "terminate
called without an active exception", exit code -6. Without the handlers the
same happens at random, when the work is freed just as the rank exits: the
abort of tests/staging/test_loader_integrations.py's 2-process Accelerate job.

The ranks end as the suite's distributed scripts end theirs, with
rank_exit.end_rank (rank 0 then sees rank 1 gone and does not join); given
``return``, they return from main() instead and rank 1 aborts every time.
"""

import atexit
import ctypes
import os
import sys
import time

RANK = int(os.environ["RANK"])
# How long rank 0 waits for rank 1 to let it join, or to be gone.
WAIT_S = 60

if RANK == 1:
    # Exit handlers run last registered first: these three run last, and the
    # two in C keep the GIL throughout (PyDLL calls do not release it), so no
    # bytecode runs where the main thread could hand the GIL to the waiting
    # gloo thread before finalization begins.
    held = ctypes.PyDLL(None)
    os.mkfifo("rank0_joined")
    joined = os.open("rank0_joined", os.O_RDWR)
    atexit.register(held.usleep, 500_000)  # 3: the gloo thread waits for the GIL
    atexit.register(held.read, joined, ctypes.create_string_buffer(1), 1)  # 2
    atexit.register(lambda: open("rank1_exiting", "w").close())  # 1: rank 0 may join

import torch  # noqa: E402 (after the exit handlers: they must run after torch's)
import torch.distributed as dist  # noqa: E402
from rank_exit import end_rank  # noqa: E402


def rank1_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def main() -> None:
    dist.init_process_group("gloo")
    if RANK == 1:
        with open("rank1.pid.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename("rank1.pid.tmp", "rank1.pid")  # rank 0 never reads half of it
        x = torch.ones(3, requires_grad=True)
        x.register_hook(lambda g: dist.all_reduce(g.detach().clone(), async_op=True) and None)
        x.sum().backward()
        return
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists("rank1.pid") and time.monotonic() < deadline:
        time.sleep(0.01)
    with open("rank1.pid") as f:
        pid = int(f.read())
    while not os.path.exists("rank1_exiting") and not rank1_gone(pid):
        if time.monotonic() > deadline:
            sys.exit(f"rank 1 neither reached its exit handlers nor ended in {WAIT_S} s")
        time.sleep(0.01)
    if os.path.exists("rank1_exiting"):
        # Alive until the end: the gloo thread frees no Python object of ours.
        kept = torch.ones(3)
        dist.all_reduce(kept)
        fd = os.open("rank0_joined", os.O_WRONLY)
        os.write(fd, b"x")
        os.close(fd)
    # Rank 0 itself exits only when its own gloo thread has long been idle.
    while not rank1_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
    if sys.argv[1:] != ["return"]:
        end_rank()
