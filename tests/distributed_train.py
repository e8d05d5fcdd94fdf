"""Two-process training with the plain and the staged DataLoader (issue 17).

Run by tests/staging/test_loader_integrations.py under torchrun (2 CPU processes,
gloo), once per framework:

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/distributed_train.py {lightning,accelerate} OUT.pt

Each process trains the same tiny MLP twice, once with
torch.utils.data.DataLoader and once with torch_stage.DataLoader built by
the same call; rank 0 saves both final parameters and what it saw of the
staged loader to OUT.pt for the test to compare.
"""

import sys

import torch
import torch.nn.functional as F
import torch.utils.data as tud
from rank_exit import end_rank

import torch_stage

SEED = 0
STAGING = dict(capacity=3, num_threads=2, name="ddp")


def dataset():
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(40, 4, generator=g)
    return tud.TensorDataset(x, x.sum(1, keepdim=True))


def make_loader(cls):
    kwargs = dict(batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(SEED))
    if cls is torch_stage.DataLoader:
        kwargs.update(STAGING)
    return cls(dataset(), **kwargs)


def mlp():
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_lightning(cls):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    pl.seed_everything(SEED, verbose=False)
    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2,
        deterministic=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, train_dataloaders=make_loader(cls))
    # What Lightning iterated: its rebuild of the loader with a
    # DistributedSampler.
    used = trainer.train_dataloader
    seen = {
        "class": f"{type(used).__module__}.{type(used).__qualname__}",
        "sampler": type(used.sampler).__name__,
        "staging": {k: getattr(used, k, None) for k in STAGING},
        "consumed": used.stats()["consumed"] if hasattr(used, "stats") else None,
    }
    return params(module.net), seen, trainer.global_rank


def run_accelerate(cls):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = make_loader(cls)
    if cls is torch_stage.DataLoader:
        model, optimizer, loader = torch_stage.staging.integrations.accelerate_prepare(
            accelerator, model, optimizer, loader
        )
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ends = []
    for _ in range(2):
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            ends.append((accelerator.gradient_state.end_of_dataloader, accelerator.sync_gradients))
    inner = loader.base_dataloader
    seen = {
        "class": f"{type(inner).__module__}.{type(inner).__qualname__}",
        "sampler": type(loader.batch_sampler).__name__,
        "staging": {k: getattr(inner, k, None) for k in STAGING},
        "consumed": inner.stats()["consumed"] if hasattr(inner, "stats") else None,
        "ends": ends,
    }
    return params(accelerator.unwrap_model(model)), seen, accelerator.process_index


def main():
    framework, out = sys.argv[1], sys.argv[2]
    run = {"lightning": run_lightning, "accelerate": run_accelerate}[framework]
    results = {}
    for key, cls in (("plain", tud.DataLoader), ("staged", torch_stage.DataLoader)):
        results[key], results[key + "_seen"], rank = run(cls)
    if rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
    # Not through interpreter finalization, which a gloo worker thread still
    # freeing a work can abort (see rank_exit).
    end_rank()
