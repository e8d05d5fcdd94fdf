"""One rank of the reliability suite's DDP job (tests/reliability/ddp.py):

    PYTHONPATH=.:tests python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/reliability/ddp_train.py {plain,staged} NUM_WORKERS OUT.pt [STAGING]

Plain PyTorch: a small MLP in DistributedDataParallel on CPU (gloo), SGD,
a map-style dataset read through a DistributedSampler (shuffled, seeded,
``set_epoch`` every epoch) by torch.utils.data.DataLoader ("plain") or by
torch_stage.DataLoader built with the very same arguments ("staged"; plus
the staging options given as JSON in STAGING, e.g. '{"num_threads": 2}'). The
dataset draws a random augmentation as it loads, so the batches' order and
the random number generators' use both show in the final parameters.

Rank 0 saves to OUT.pt the final parameters, and from every rank its
parameters, the dataset indices it trained on, its losses and (staged) the
loader's stats after each epoch.
"""

import faulthandler
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.data as tud
from rank_exit import end_rank
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

import torch_stage

SEED = 0
EPOCHS = 2
BATCH_SIZE = 4
# Not a multiple of ranks x batch size: the sampler pads, the last batch is short.
EXAMPLES = 90


class NoisyRegression(tud.Dataset):
    """Fixed inputs and targets; each load adds noise from torch's global
    RNG (the worker's, or the process's with num_workers=0)."""

    def __init__(self):
        g = torch.Generator().manual_seed(SEED)
        self.x = torch.randn(EXAMPLES, 8, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(8, 2, generator=g))

    def __len__(self):
        return EXAMPLES

    def __getitem__(self, i):
        return self.x[i] + 0.05 * torch.randn(8), self.y[i], i


def mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
        torch.nn.Linear(16, 2),
    )  # fmt: skip


def main():
    kind, num_workers, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    staging = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    # A hang prints every thread's stack and ends the rank (torchrun then
    # ends the job) before the scenario's own limit.
    faulthandler.dump_traceback_later(float(os.environ.get("DDP_TRAIN_LIMIT_S", "300")), exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    model = DistributedDataParallel(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dataset = NoisyRegression()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    kwargs = dict(batch_size=BATCH_SIZE, sampler=sampler, num_workers=num_workers)
    if kind == "plain":
        loader = tud.DataLoader(dataset, **kwargs)
    else:
        loader = torch_stage.DataLoader(dataset, **kwargs, **staging)
    seen, losses, stats = [], [], []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        batches = 0
        for x, y, index in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            seen.extend(index.tolist())
            losses.append(loss.item())
            batches += 1
        epoch_stats = {"batches": batches, "len": len(loader)}
        if hasattr(loader, "stats"):
            s = loader.stats()
            epoch_stats.update(consumed=s.get("consumed"), produced=s.get("produced"))
        stats.append(epoch_stats)
    params = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    mine = {
        "rank": rank,
        "loader": f"{type(loader).__module__}.{type(loader).__qualname__}",
        "staging": {k: getattr(loader, k) for k in staging},
        "params": params,
        "seen": seen,
        "losses": losses,
        "stats": stats,
    }
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        torch.save({"params": params, "ranks": ranks}, out)
    dist.barrier()
    dist.destroy_process_group()
    # Ended here, the watchdog still armed, while main's locals still hold
    # the model: freeing it frees DDP's reducer and, with it, the last
    # reference to the process group. ~ProcessGroupGloo, run with the GIL
    # held, takes the group's work lock while its worker thread, holding
    # that lock, waits for the GIL to free the barrier's work (a tensor
    # all_gather_object made): a rank of make torture hung there for good
    # (pytorch/pytorch#56297: the group's own Python binding drops the GIL
    # first, the reducer's destructor does not).
    # And not through interpreter finalization, which a gloo worker thread
    # still freeing a work can abort (see rank_exit).
    end_rank()


if __name__ == "__main__":
    main()
