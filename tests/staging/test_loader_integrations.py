"""torch_stage.DataLoader under PyTorch Lightning and Hugging Face Accelerate
(issue 17, item 6), with the real packages: each scenario runs with the
plain DataLoader and with torch_stage.DataLoader built by the same call, and
compares what training ends with (bit-equal parameters), what the framework
saw, and that staging actually ran. Skipped where a package is missing:

    pip install -r requirements-dev.txt   # lightning, accelerate
    python -m pytest tests/staging/test_loader_integrations.py -q
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.data as tud
from conftest import ROOT

import torch_stage
from torch_stage.staging import integrations

PLAIN = tud.DataLoader
SEED = 0
STAGING = dict(capacity=3, num_threads=2, name="integration", timeout_millis=60_000)
WORKERS = [
    pytest.param(0, id="0workers"),
    pytest.param(2, id="2workers", marks=pytest.mark.workers),
]
# The 2-process runs start 2 interpreters that import torch and the
# framework on a busy machine: most of their time is start-up.
DISTRIBUTED_TIMEOUT_S = 150


def dataset(n=36):
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(n, 4, generator=g)
    return tud.TensorDataset(x, x.sum(1, keepdim=True))


def make_loader(cls, num_workers=0, shuffle=True, n=36, **kwargs):
    """The same constructor call for both classes; ours also stages."""
    kwargs = dict(kwargs, batch_size=4, shuffle=shuffle, num_workers=num_workers)
    if shuffle:
        kwargs["generator"] = torch.Generator().manual_seed(SEED)
    if cls is not PLAIN:
        kwargs.update(STAGING)
    return cls(dataset(n), **kwargs)


def mlp():
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def assert_same_params(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_staged(loader, batches):
    """``loader`` is ours, with STAGING, and its last epoch went through its
    staging threads."""
    assert isinstance(loader, torch_stage.DataLoader)
    for key, value in STAGING.items():
        assert getattr(loader, key) == value, key
    stats = loader.stats()
    assert stats["consumed"] == batches and stats["produced"] >= batches, stats


@pytest.fixture(autouse=True)
def keep_deterministic_algorithms():
    # Lightning's deterministic=True switches torch's process-wide flag on
    # and leaves it on.
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def run_distributed(tmp_path, framework):
    out = tmp_path / f"{framework}.pt"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            os.path.join(ROOT, "tests", "distributed_train.py"),
            framework,
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=DISTRIBUTED_TIMEOUT_S,
        env=env,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out, weights_only=False)


def assert_distributed_staged(seen, sampler):
    assert seen["class"] == "torch_stage.staging.loader.DataLoader", seen
    assert seen["sampler"] == sampler, seen
    assert seen["staging"] == {"capacity": 3, "num_threads": 2, "name": "ddp"}, seen
    # 40 examples over 2 processes in batches of 4: 5 batches each.
    assert seen["consumed"] == 5, seen


# --- PyTorch Lightning -------------------------------------------------------


@pytest.fixture
def pl():
    return pytest.importorskip("lightning.pytorch")


def lightning_module(pl):
    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.mse_loss(self.net(x), y))

        def predict_step(self, batch, batch_idx):
            return self.net(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Module()


def lightning_trainer(pl, **kwargs):
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        deterministic=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        **kwargs,
    )


def lightning_run(pl, cls, num_workers):
    pl.seed_everything(SEED, verbose=False)
    module = lightning_module(pl)
    # Batch indices as Lightning's prediction writers get them: predict
    # rebuilds the loader around a batch sampler that records them, which
    # staging reads ahead of the loop.
    writer_indices = []

    class Writer(pl.callbacks.BasePredictionWriter):
        def write_on_batch_end(self, trainer, module, prediction, batch_indices, *args):
            writer_indices.append(list(batch_indices))

    trainer = lightning_trainer(pl, callbacks=[Writer("batch")])
    train = make_loader(cls, num_workers)
    val = make_loader(cls, num_workers, shuffle=False)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    if cls is not PLAIN:
        assert_staged(train, 9)
        assert_staged(val, 9)
    validated = trainer.validate(module, dataloaders=make_loader(cls, num_workers, shuffle=False))
    predict = make_loader(cls, num_workers, shuffle=False)
    predicted = trainer.predict(module, dataloaders=predict)
    used = trainer.predict_dataloaders
    assert type(used) is cls
    if cls is not PLAIN:
        assert_staged(used, 9)
    return params(module.net), validated, torch.cat(predicted), writer_indices


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", WORKERS)
def test_lightning_fit_validate_predict_match_the_plain_loader(pl, num_workers):
    trained, validated, predicted, indices = lightning_run(pl, PLAIN, num_workers)
    trained2, validated2, predicted2, indices2 = lightning_run(
        pl, torch_stage.DataLoader, num_workers
    )
    assert_same_params(trained, trained2)
    assert trained["0.weight"].ne(mlp()[0].weight).any()  # it did train
    assert validated == validated2
    assert torch.equal(predicted, predicted2)
    assert indices == indices2 == [list(range(i, i + 4)) for i in range(0, 36, 4)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["training", "predicting"])
def test_a_loader_lightning_rebuilds_stays_staged(pl, mode):
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader

    stage = RunningStage.TRAINING if mode == "training" else RunningStage.PREDICTING
    rebuilt = {}
    for cls in (PLAIN, torch_stage.DataLoader):
        made = make_loader(cls, shuffle=False, n=40, drop_last=True)
        sampler = tud.DistributedSampler(made.dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
        rebuilt[cls] = _update_dataloader(made, sampler, mode=stage)
    ours = rebuilt[torch_stage.DataLoader]
    assert type(ours) is torch_stage.DataLoader
    plain = rebuilt[PLAIN]
    assert (ours.batch_size, ours.drop_last) == (plain.batch_size, plain.drop_last)
    assert type(ours.batch_sampler) is type(plain.batch_sampler)  # predict's index tracker
    batches = [[t.tolist() for t in b] for b in rebuilt[PLAIN]]
    assert [[t.tolist() for t in b] for b in ours] == batches
    assert_staged(ours, len(batches))


@pytest.mark.timeout(180)
def test_lightning_ddp_two_processes_match_the_plain_loader(pl, tmp_path):
    results = run_distributed(tmp_path, "lightning")
    assert_same_params(results["plain"], results["staged"])
    assert results["plain_seen"]["class"] == "torch.utils.data.dataloader.DataLoader"
    # Lightning rebuilt our loader with a DistributedSampler, and it staged.
    assert_distributed_staged(results["staged_seen"], "DistributedSampler")


# --- Hugging Face Accelerate -------------------------------------------------


@pytest.fixture
def accelerate():
    module = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    # Accelerator's state is process-wide: start each test from none.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield module
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def accelerate_prepare(accelerator, cls, *objects):
    if cls is PLAIN:
        return accelerator.prepare(*objects)
    return integrations.accelerate_prepare(accelerator, *objects)


def accelerate_train(accelerate, cls, num_workers):
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    # 9 batches: the last of an epoch is an odd one out that only
    # end_of_dataloader makes Accelerate step on.
    loader = make_loader(cls, num_workers)
    model, optimizer, loader = accelerate_prepare(accelerator, cls, model, optimizer, loader)
    steps = []
    for _ in range(2):
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            steps.append((accelerator.gradient_state.end_of_dataloader, accelerator.sync_gradients))
    if cls is not PLAIN:
        assert_staged(loader.base_dataloader, 9)
    return params(accelerator.unwrap_model(model)), steps


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", WORKERS)
def test_accelerate_gradient_accumulation_matches_the_plain_loader(accelerate, num_workers):
    trained, steps = accelerate_train(accelerate, PLAIN, num_workers)
    trained2, steps2 = accelerate_train(accelerate, torch_stage.DataLoader, num_workers)
    assert_same_params(trained, trained2)
    assert trained["0.weight"].ne(mlp()[0].weight).any()
    epoch = [(False, False), (False, True)] * 4 + [(True, True)]
    assert steps == steps2 == epoch * 2


def skipped_batches(accelerator, cls, loader, n):
    if cls is PLAIN:
        skipping = accelerator.skip_first_batches(loader, n)
    else:
        skipping = integrations.accelerate_skip_first_batches(accelerator, loader, n)
    ends = []
    batches = []
    for x, _ in skipping:
        batches.append(x.tolist())
        ends.append(accelerator.gradient_state.end_of_dataloader)
    return skipping, batches, ends


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "unprepared"])
def test_accelerate_skip_first_batches_matches_the_plain_loader(accelerate, prepared):
    accelerator = accelerate.Accelerator(cpu=True)
    seen = {}
    for cls in (PLAIN, torch_stage.DataLoader):
        loader = make_loader(cls)
        if prepared:
            loader = accelerate_prepare(accelerator, cls, loader)
        skipping, batches, ends = skipped_batches(accelerator, cls, loader, 3)
        seen[cls] = batches, ends if prepared else None
        if cls is not PLAIN:
            inner = skipping.__dict__.get("base_dataloader", skipping)
            assert_staged(inner, 6)
    assert seen[PLAIN] == seen[torch_stage.DataLoader]
    assert len(seen[PLAIN][0]) == 6
    if prepared:
        assert seen[PLAIN][1] == [False] * 5 + [True]


class Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(torch.arange(22.0).view(11, 2))


@pytest.mark.timeout(60)
def test_accelerate_an_iterable_dataset_matches_the_plain_loader(accelerate):
    accelerator = accelerate.Accelerator(cpu=True)
    seen = {}
    for cls in (PLAIN, torch_stage.DataLoader):
        kwargs = STAGING if cls is not PLAIN else {}
        loader = accelerate_prepare(accelerator, cls, cls(Stream(), batch_size=2, **kwargs))
        whole = [b.tolist() for b in loader]
        skipping = (
            accelerator.skip_first_batches(loader, 2)
            if cls is PLAIN
            else integrations.accelerate_skip_first_batches(accelerator, loader, 2)
        )
        seen[cls] = whole, [b.tolist() for b in skipping]
        if cls is not PLAIN:
            # The skipped batches are read and dropped (by Accelerate).
            assert_staged(skipping.base_dataloader, 6)
    assert seen[PLAIN] == seen[torch_stage.DataLoader]
    assert seen[PLAIN][1] == seen[PLAIN][0][2:]


@pytest.mark.timeout(60)
def test_accelerate_state_dict_resumes_where_the_loop_was(accelerate):
    accelerator = accelerate.Accelerator(cpu=True)
    whole = [x.tolist() for x, _ in accelerate_prepare(accelerator, PLAIN, make_loader(PLAIN))]
    loader = accelerate_prepare(
        accelerator, torch_stage.DataLoader, make_loader(torch_stage.DataLoader)
    )
    it = iter(loader)
    first = [next(it)[0].tolist() for _ in range(4)]
    state = loader.state_dict()
    del it
    again = accelerate_prepare(
        accelerator, torch_stage.DataLoader, make_loader(torch_stage.DataLoader)
    )
    again.load_state_dict(state)
    rest = [x.tolist() for x, _ in again]
    assert first + rest == whole


@pytest.mark.timeout(60)
def test_accelerate_warns_when_it_would_drop_staging(accelerate):
    accelerator = accelerate.Accelerator(cpu=True)
    loader = make_loader(torch_stage.DataLoader)
    with pytest.warns(UserWarning, match=r"accelerate_prepare\(accelerator") as caught:
        prepared = accelerator.prepare(loader)
    (warning,) = [w for w in caught if "torch_stage" in str(w.message)]
    # Aimed at the line that called accelerator.prepare, naming the options.
    assert warning.filename == __file__
    assert "capacity=3" in str(warning.message)
    assert type(prepared.base_dataloader) is PLAIN
    with pytest.warns(UserWarning, match=r"accelerate_skip_first_batches"):
        accelerator.skip_first_batches(loader, 1)
    # Through the helpers, and reading the attribute anywhere else: quiet.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = integrations.accelerate_prepare(accelerator, loader)
        integrations.accelerate_skip_first_batches(accelerator, prepared, 1)
        assert prepared.prefetch_factor is None and loader.prefetch_factor is None
    assert not [w for w in caught if "torch_stage" in str(w.message)]


@pytest.mark.timeout(60)
def test_accelerate_prepare_warns_for_a_wrapper_it_cannot_restage(accelerate, monkeypatch):
    accelerator = accelerate.Accelerator(cpu=True)

    class XlaLikeWrapper:  # holds its loader elsewhere than base_dataloader
        pass

    monkeypatch.setattr(accelerator, "prepare", lambda *objects: XlaLikeWrapper())
    loader = make_loader(torch_stage.DataLoader)
    with pytest.warns(UserWarning, match=r"XlaLikeWrapper.*capacity=3.*is dropped") as caught:
        integrations.accelerate_prepare(accelerator, loader)
    assert caught[0].filename == __file__


@pytest.mark.timeout(180)
def test_accelerate_two_processes_match_the_plain_loader(accelerate, tmp_path):
    results = run_distributed(tmp_path, "accelerate")
    assert_same_params(results["plain"], results["staged"])
    assert results["plain_seen"]["ends"] == results["staged_seen"]["ends"]
    # Accelerate sharded the batches, and our loader read the shard.
    assert_distributed_staged(results["staged_seen"], "BatchSamplerShard")
