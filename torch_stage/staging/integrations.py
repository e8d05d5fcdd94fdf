"""torch_stage.DataLoader with training frameworks.

PyTorch Lightning needs nothing here: it rebuilds a loader (to inject a
DistributedSampler, or to track indices in ``predict``) from the class's
``__init__`` signature and the instance's attributes, and the staging
options are both.

Hugging Face Accelerate rebuilds every loader it prepares as a plain
``torch.utils.data.DataLoader`` inside its own wrapper
(``DataLoaderShard`` / ``DataLoaderDispatcher``, which shard the batches,
synchronise the RNGs and tell ``accelerator.gradient_state`` which batch is
the last), and has no hook for the loader's class. So these helpers let
Accelerate prepare the loader as usual and then put a ``torch_stage``
loader, built from the wrapper's new plain one plus the original staging
options, back inside the wrapper: sharding, ``end_of_dataloader`` and
gradient accumulation stay Accelerate's own, and batches are staged.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch.utils.data

from torch_stage.staging.loader import DataLoader

__all__ = ["accelerate_prepare", "accelerate_skip_first_batches"]

# The plain DataLoader's options besides the dataset and how it is sampled
# (those are rebuilt from the sampler actually in use). in_order is
# torch >= 2.6; the others are as old as torch 2.0.
_PLAIN_OPTIONS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def _restaged(plain: torch.utils.data.DataLoader, staging: dict) -> DataLoader:
    """A torch_stage.DataLoader reading as ``plain`` does, staged as
    ``staging`` says."""
    kwargs = {k: getattr(plain, k) for k in _PLAIN_OPTIONS if hasattr(plain, k)}
    if isinstance(plain.dataset, torch.utils.data.IterableDataset):
        # The plain loader made its own batch sampler over an infinite
        # sampler; an iterable dataset may not be given one.
        kwargs.update(batch_size=plain.batch_size, drop_last=plain.drop_last)
    elif plain.batch_sampler is not None:
        kwargs["batch_sampler"] = plain.batch_sampler
    else:
        # batch_size=None: the sampler yields whole batches (Accelerate's
        # case of a BatchSampler passed as sampler) or items unbatched.
        kwargs.update(sampler=plain.sampler, batch_size=None)
    return DataLoader(plain.dataset, **kwargs, **staging)


def _staging_of(loader) -> Optional[dict]:
    """The staging options of a torch_stage.DataLoader, or of the one inside
    an Accelerate wrapper; None for any other loader."""
    inner = getattr(loader, "__dict__", {}).get("base_dataloader", loader)
    if not isinstance(inner, DataLoader):
        return None
    return inner.staging_options()


def _restage_wrapper(wrapped, staging: dict):
    """Put a staged loader inside Accelerate's wrapper ``wrapped`` (in place),
    or make the plain loader Accelerate returned a staged one."""
    plain = wrapped.__dict__.get("base_dataloader")
    if plain is None:
        # Not a wrapper: skip_first_batches on an unprepared loader returns
        # a plain DataLoader over a skipping batch sampler.
        if type(wrapped) is torch.utils.data.DataLoader:
            return _restaged(wrapped, staging)
        # XLA's MpDeviceLoaderWrapper, or a wrapper a later Accelerate
        # introduces: it works, unstaged, and says so.
        warnings.warn(
            f"accelerate returned a {type(wrapped).__module__}.{type(wrapped).__qualname__} "
            f"that torch_stage.staging.integrations cannot put a staged loader into, so the "
            "staging "
            f"({', '.join(f'{k}={v!r}' for k, v in staging.items())}) is dropped; batches come "
            "from a plain DataLoader. Report the accelerate version and setup to torch_stage.",
            UserWarning,
            stacklevel=3,
        )
        return wrapped
    staged = _restaged(plain, staging)
    wrapped.base_dataloader = staged
    # DataLoaderAdapter.state_dict() returns this snapshot, taken from the
    # plain loader (which has none) when the wrapper was made.
    wrapped.dl_state_dict = staged.state_dict()
    return wrapped


class _Quiet:
    """Mark loaders as being rebuilt by these helpers, so that their
    prefetch_factor read does not warn that staging is dropped."""

    def __init__(self, loaders):
        self._loaders = [loader for loader in loaders if loader is not None]

    def __enter__(self):
        for loader in self._loaders:
            loader.__dict__["_accelerate_integration"] = True

    def __exit__(self, *exc):
        for loader in self._loaders:
            loader.__dict__.pop("_accelerate_integration", None)


def _inner(loader):
    inner = getattr(loader, "__dict__", {}).get("base_dataloader", loader)
    return inner if isinstance(inner, DataLoader) else None


def accelerate_prepare(accelerator, *objects: Any, device_placement=None):
    """``accelerator.prepare(*objects)`` that keeps torch_stage.DataLoader
    staging.

    Use it in place of ``accelerator.prepare`` with the same arguments
    (models, optimizers, schedulers and loaders, in any order); it returns
    what that returns. Each torch_stage.DataLoader comes back as
    Accelerate's usual wrapper (sharded across processes, RNGs synchronised,
    ``accelerator.gradient_state.end_of_dataloader`` set on the last batch,
    ``state_dict()`` from the staged loader) reading from a
    torch_stage.DataLoader with the original staging options. Other objects
    are prepared as ``accelerator.prepare`` does.

    Pass ``device=accelerator.device`` to the loader to have the
    host-to-device copy done on the staging threads; Accelerate's own
    device placement then finds the batches already there.
    """
    staging = [_staging_of(obj) for obj in objects]
    with _Quiet([_inner(obj) for obj in objects]):
        if device_placement is None:
            prepared = accelerator.prepare(*objects)
        else:
            prepared = accelerator.prepare(*objects, device_placement=device_placement)
    single = len(objects) == 1
    results = [prepared] if single else list(prepared)
    for i, options in enumerate(staging):
        if options is not None:
            results[i] = _restage_wrapper(results[i], options)
    return results[0] if single else tuple(results)


def accelerate_skip_first_batches(accelerator, loader, num_batches: int = 0):
    """``accelerator.skip_first_batches(loader, num_batches)`` that keeps
    torch_stage.DataLoader staging (for a loader prepared with
    ``accelerate_prepare`` or not). The skipped batches are never loaded,
    as with Accelerate's own."""
    options = _staging_of(loader)
    with _Quiet([_inner(loader)]):
        skipping = accelerator.skip_first_batches(loader, num_batches=num_batches)
    if options is None:
        return skipping
    return _restage_wrapper(skipping, options)
