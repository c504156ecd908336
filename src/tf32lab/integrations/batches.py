"""The run's first batches, read again for the training check without taking them from the run: every random
stream and sampler generator put back afterwards, a persistent loader's iterator left to the run, and a stream that
cannot be read twice refused (:func:`first_batches`); then grouped into optimizer steps (:func:`grouped`), as many
as the run itself trains (:func:`within`).

Example:

    >>> import torch
    >>> from torch.utils.data import DataLoader
    >>> loader = DataLoader(list(range(12)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    >>> first = first_batches(loader, 4, move=lambda b: b)
    >>> [b.tolist() for b in first] == [b.tolist() for b in list(loader)[:4]]   # the run reads the same ones
    True
    >>> [(step, len(micro)) for step, micro in grouped(first, accumulate=2, steps=5)]  # two steps of two batches
    [(0, 2), (1, 2)]
"""

from __future__ import annotations

import collections.abc
import contextlib
import inspect
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, Optional

import torch

from tf32lab.errors import Tf32LabError


def loaders(loader: Any) -> list[Any]:
    """The dataloaders in ``loader``: itself, or each one of a collection of them (Lightning's several train
    dataloaders, a dict or a list, which its ``CombinedLoader`` reads together)."""
    if isinstance(loader, Mapping):
        return [one for value in loader.values() for one in loaders(value)]
    if isinstance(loader, (list, tuple)):
        return [one for value in loader for one in loaders(value)]
    return [loader]


def loader_generators(loader: Any) -> list[torch.Generator]:
    """Every torch generator a dataloader's sampling draws from (its own, its sampler's, its batch sampler's), of
    each dataloader in a collection of them."""
    found: list[torch.Generator] = []
    owners = [owner for one in loaders(loader) for owner in (
        one, getattr(one, "sampler", None), getattr(one, "batch_sampler", None),
        getattr(getattr(one, "batch_sampler", None), "sampler", None))]
    for owner in owners:
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


@contextlib.contextmanager
def loader_kept(loader: Any) -> Iterator[Callable[[], None]]:
    """The dataloader's own generators as they were on exit (the process's random streams are kept apart); it
    gives the function that puts them back at once."""
    generators = loader_generators(loader)
    states = [g.get_state() for g in generators]

    def put_back() -> None:
        for generator, state in zip(generators, states):
            generator.set_state(state)

    # a loader with persistent workers keeps one iterator (and its workers' random streams, which a dataset's
    # augmentation draws from) for every pass, the run's already made when training starts: the check's pass gets
    # its own, ended here, and the run's goes on untouched (a pass over the loader would reset it)
    persistent = [one for one in {id(o): o for o in _with_bases(loader)}.values()
                  if getattr(one, "persistent_workers", False) and getattr(one, "num_workers", 0) > 0
                  and hasattr(one, "_iterator")]
    iterators = [one._iterator for one in persistent]
    try:
        for one in persistent:
            one._iterator = None
        yield put_back
    finally:
        for generator, state in zip(generators, states):
            generator.set_state(state)
        for one, iterator in zip(persistent, iterators):
            made, one._iterator = one._iterator, iterator
            if made is not None and made is not iterator and hasattr(made, "_shutdown_workers"):
                made._shutdown_workers()


def _with_bases(loader: Any) -> list[Any]:
    """The dataloaders in ``loader`` and the ones they wrap (accelerate's ``base_dataloader``)."""
    found = []
    for one in loaders(loader):
        found.append(one)
        if getattr(one, "base_dataloader", None) is not None:
            found.append(one.base_dataloader)
    return found


def first_batches(loader: Any, count: int, move: Callable[[Any], Any], iterate: Callable[[Any], Iterator[Any]] = iter,
                  made: Optional[torch.Tensor] = None, before: Optional[torch.Tensor] = None,
                  generators: Sequence[tuple[torch.Generator, torch.Tensor]] = (), prefetch: int = 0,
                  per_batch: Optional[list[bool]] = None) -> list[Any]:
    """The first ``count`` batches of a fresh pass over ``loader`` (each through ``move``), the loader's
    generators put back afterwards; fewer when it has fewer.

    ``made``: the run made its pass's iterator already (Lightning makes it before ``on_train_start``), which drew
    its seed, and its sampler has not drawn its order yet, which it will draw from the loader's generators as
    they are and from PyTorch's CPU generator at the state ``made``: the check's pass draws its order from the
    same states, put back between its iterator's making and its first batch.

    ``before``: the state of PyTorch's CPU generator that the run's pass is made from (Hugging Face's, made after
    the hook) or was made from (Lightning's with workers, which drew its order then too: its first indices are
    handed out as it is made): the check's pass is made from the same state, its seed, order and augmentations
    drawn as the run's are (the check's own kept streams have drawn a seed since).

    ``generators``: ``(generator, state)`` of the loader's own generators as they were when the run made its
    iterator (it drew its workers' seed from them, and a sampler with workers its first order), set before the
    check's pass is made. ``prefetch``: batches the run read as it made its iterator (Lightning reads one ahead
    from a loader without a length), read so here too, before ``made``. ``per_batch``: given a list, whether
    reading the batches after the first drew from PyTorch's CPU stream (an augmentation in the main process) is
    appended to it (:func:`interleaved`)."""
    _read_again(loader)
    found: list[Any] = []
    with loader_kept(loader) as put_back:
        for generator, state in generators:
            generator.set_state(state)
        if before is not None:
            torch.random.set_rng_state(before)
        batches = iterate(loader)
        try:
            early = list(itertools.islice(batches, min(prefetch, count)))
            if made is not None:
                put_back()
                torch.random.set_rng_state(made)
            first: Optional[torch.Tensor] = None
            for batch in itertools.chain(early, batches):
                found.append(move(_plain(batch)))
                if len(found) == 1 and per_batch is not None:
                    first = torch.random.get_rng_state()
                if len(found) == count:
                    break
            if per_batch is not None:
                per_batch.append(first is not None and not torch.equal(first, torch.random.get_rng_state()))
        finally:
            del batches  # a multi-process loader's workers end here
    return found


def interleaved(model: torch.nn.Module, per_batch: Sequence[bool]) -> Optional[str]:
    """A note where the loader draws from PyTorch's CPU stream as it reads each batch (``per_batch``, from
    :func:`first_batches`: a random augmentation in the main process) and the model draws from it as it trains (a
    dropout of p > 0): the run reads a batch, then trains a step drawing its dropout, then reads the next, where the
    check reads its batches at once, so its batches after the first are drawn with other numbers (the run's rows
    in the run's order where the sampler draws its order as a pass begins, as PyTorch's do). Workers draw from
    streams of their own, and a model without dropout draws nothing between batches: no note."""
    dropout = any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())
    if not (any(per_batch) and dropout):
        return None
    return ("the train dataloader draws from PyTorch's random stream as it reads each batch (an augmentation in "
            "the main process) and the model's dropout draws from it between the run's batches: the check read its "
            "batches at once, so its batches after the first were augmented with other draws than the run's (their "
            "rows and order the run's where the sampler draws its order as a pass begins, as PyTorch's do); give "
            "the loader num_workers >= 1 (their streams are their own) for the run's own")


def _read_again(loader: Any) -> None:
    """Refused (one line, nothing read) where the loader's stream cannot be read again: an ``IterableDataset``
    whose ``iter`` hands out the same iterator every time would lose the batches the check reads."""
    for one in loaders(loader):
        _one_read_again(one)


def _one_read_again(loader: Any) -> None:
    # Lightning trains on any iterable: a generator of batches (or map, zip, iter(list)) is its own one pass. An
    # iterator of a class of its own may make a fresh pass at each iter() (Lightning's CombinedLoader does)
    if inspect.isgenerator(loader) or (isinstance(loader, collections.abc.Iterator)
                                       and type(loader).__module__ in ("builtins", "itertools")):
        kind = "a generator" if inspect.isgenerator(loader) else f"an iterator ({type(loader).__name__})"
        raise Tf32LabError(f"the train dataloader is {kind}, read once: the batches the check read would be gone "
                           f"from the run; give an iterable that makes a fresh pass at each iter() (a DataLoader, "
                           f"a list), or leave the check out")
    dataset = getattr(getattr(loader, "base_dataloader", loader), "dataset", None)
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        return
    first, second = iter(dataset), iter(dataset)  # a generator's body has not run yet: nothing is drawn
    if first is second:
        raise Tf32LabError(f"the train dataloader's {type(dataset).__name__} hands out one shared iterator (its "
                           f"__iter__ returns the same object each time): the batches the check read would be "
                           f"gone from the run; make __iter__ return a fresh iterator (a generator), or leave the "
                           f"check out")


def _plain(batch: Any) -> Any:
    """A mapping batch (``BatchEncoding``, a ``UserDict``) as a dict, which the check's copies keep as such."""
    return dict(batch.items()) if isinstance(batch, Mapping) and not isinstance(batch, dict) else batch


def within(steps: int, max_steps: Any, done: Any, notes: list[str], why: str = "max_steps") -> int:
    """The steps to check: ``steps``, or fewer where the run itself trains fewer (``max_steps`` in all, ``done``
    of them done already; ``why``: what sets that number), with a note saying so: the check trains no step the run
    does not.

    >>> notes = []
    >>> within(20, 5, 0, notes), notes
    (5, ['the run trains 5 optimizer steps (max_steps): 5 of the 20 steps asked for were checked'])
    >>> within(20, -1, 0, [])   # no max_steps
    20
    """
    left = int(max_steps) - int(done or 0) if isinstance(max_steps, int) and max_steps > 0 else steps
    if 0 < left < steps:
        notes.append(f"the run trains {left} optimizer step{'s' if left > 1 else ''} ({why}): {left} of the {steps} "
                     f"steps asked for were checked")
        return left
    return steps


def grouped(batches: list[Any], accumulate: int, steps: int, ended: bool = False) -> list[tuple[int, list[Any]]]:
    """``(step, micro_batches)`` for each optimizer step the batches make whole; ``ended``: the batches are all the
    run's epoch has, and the ones left over make one more step, as both frameworks step the optimizer at an epoch's
    last batch whatever the accumulation.

    >>> [(step, len(micro)) for step, micro in grouped(list(range(5)), accumulate=3, steps=4, ended=True)]
    [(0, 3), (1, 2)]
    """
    whole = min(steps, len(batches) // accumulate)
    made = [(k, batches[k * accumulate:(k + 1) * accumulate]) for k in range(whole)]
    if ended and whole < steps and len(batches) > whole * accumulate:
        made.append((whole, batches[whole * accumulate:]))
    return made
