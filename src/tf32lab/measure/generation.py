"""``check_generation(workload)``: what each precision level does to the text a causal language model generates.

Every row decodes greedily (the top-1 token at each step) ``new_tokens`` tokens from the same prompts, the same
weights and the same cache settings, from the same random seed:

- **float64**, the reference: the float32 model run with every op widened (``measure.reference.Float64Run``, no
  copy of the weights);
- **float32** at ``highest`` on the target (emulated, or native with ``target="native"``): float32's own distance
  from float64's tokens, shown beside every level;
- each level, emulated as the target computes it (or run natively).

Per row: the first step (1-based) whose token is not float64's, per prompt, and its median; then one forward
over each prompt followed by float64's tokens (*teacher-forced*: every row sees float64's text) gives the share
of steps whose top-1 token is float64's, the largest logit error at each step, and the mean token loss on the
prompts' own text (its change from float64's; perplexity is its exponential). A row stops decoding once every
prompt has left float64's tokens: what it would generate after that is another text, not a measure.

A prompt's text ends where float64's writes an end-of-text token (the tokenizer's ``eos_token_id`` and the model's
``generation_config.eos_token_id``, where ``generate()`` stops): a row's tokens are compared up to it, that token
included, and teacher-forced agreement counts those steps only. What a model writes after its end of text is no
text a user sees, and a row that ended there too has not left float64's text.

Greedy decoding only: sampling (``temperature > 0``) draws from distributions that differ by rounding, so two
rows would differ by chance as much as by precision; it is refused.

Nothing of the caller's changes: the model runs in eval mode (its mode put back), its buffers are put back after
each row, and PyTorch's flags and random state are as they were on every exit, exceptions and Ctrl-C included.

Example:

    >>> import torch, tf32lab
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> model = torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.Linear(32, 50))
    >>> report = tf32lab.check_generation(model, new_tokens=4, prompts=[[1, 2, 3], [4, 5]],
    ...                                   levels=("highest",), use_cache=False)
    >>> report.level("highest").divergence, bool(report)
    ((None, None), True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import numbers
import operator
import time
from collections.abc import Iterable, Sequence
from typing import Any, Optional, Union

import torch

from tf32lab.emulation.emulator import check_accumulation, context_cells, families_met, release_buffers
from tf32lab.errors import Tf32LabError
from tf32lab.know.levels import LEVELS, check_levels
from tf32lab.know.targets import Target
from tf32lab.machine.hardware import resolve_target
from tf32lab.measure.check import alike_levels, refuse_native_levels, rows_of_alike
from tf32lab.measure.draws import Streams, cuda_devices
from tf32lab.measure.layers import described, level_context, out_of_memory
from tf32lab.measure.reference import Float64Run
from tf32lab.measure.state import state_kept, stateful_note, written_note
from tf32lab.numbers.origin import internal_error
from tf32lab.report.generation import FLOOR, Criterion, GenerationLevel, GenerationReport
from tf32lab.workloads import samples
from tf32lab.workloads.experts import experts_eager
from tf32lab.workloads.hf import CausalLM, embedding_rows
from tf32lab.workloads.quiet import quiet_loading
from tf32lab.workloads.running import Progress, changed_note, environment_of, exits_refused, kept_flags
from tf32lab.workloads.workload import Workload, check_float32, eval_mode, training_note

__all__ = ["DEFAULT_PROMPTS", "check_generation"]

# when a tokenizer is given and no prompts: 8 of the sample sentences, each subject and each ending once (the
# sentences are every subject with every ending, 8 x 8, so every 9th is the diagonal). The first 8 shared one
# subject, and their text and loss said less about a model than 8 different openings do.
DEFAULT_PROMPTS: tuple[str, ...] = samples.SENTENCES[::9]
_MAX_NEW_TOKENS = 100_000
# state-space decoders whose mixers multiply the tokens fed by the attention mask ([batch, fed]): generate() gives
# them the mask at the first forward only (their prepare_inputs_for_generation drops it after), and the whole
# sequence's mask beside one cached token broadcast it to every position (a Mamba's cached tokens were not its own)
_MASK_AT_PREFILL = frozenset({"mamba", "mamba2", "falcon_mamba"})


def check_generation(workload: Union[CausalLM, torch.nn.Module], *, new_tokens: int = 32,
                     levels: Iterable[str] = LEVELS, target: Union[str, Target] = "a100",
                     prompts: Optional[Sequence[Any]] = None, criterion: Optional[str] = None,
                     use_cache: bool = True, temperature: float = 0.0, accumulation: Optional[str] = None,
                     progress: bool = False) -> GenerationReport:
    """Decode ``new_tokens`` tokens greedily from each prompt at each level, in float64 and in float32 `highest`.

    Args:
        workload: a :class:`~tf32lab.workloads.hf.CausalLM` (``hf.causal_lm(folder)``), or a causal model: a
            module mapping ``input_ids`` ``[batch, seq]`` to logits ``[batch, seq, vocab]`` (a tensor, or an
            output with ``.logits``). A module whose ``forward`` takes ``attention_mask`` and a cache
            (``cache``, or ``past_key_values`` before transformers 5) is fed those and its positions.
        new_tokens: tokens generated per prompt (at least 1).
        levels: precision levels to check, in order.
        target: a hardware profile from ``tf32lab.targets`` (emulated here), or ``"native"``.
        prompts: texts (with a tokenizer: tokenized as ``tokenizer(text)`` does for ``generate()``, with the
            special tokens it puts before the text, not those it appends after it) or lists of token ids (taken
            as given; a 1-D tensor or NumPy array is one prompt, a 2-D one a prompt a row); by default
            ``DEFAULT_PROMPTS``, 8 sample sentences that share no subject and no ending (with a tokenizer; a plain
            model needs prompts).
        criterion: what a level must do to pass (``tf32lab.report.generation.Criterion``): ``"divergence>K"``,
            ``"agreement>=X"`` or ``"perplexity<X"``; by default ``divergence>new_tokens``: every new token equals
            float64's on every prompt.
        use_cache: decode with the model's key/value cache (one forward of the last token per step) or without
            (the whole sequence each step); the same tokens either way. A model that takes no cache always runs
            the whole sequence.
        temperature: 0 (greedy); sampling is refused.
        accumulation: how emulated GEMMs sum their products (``emulate()``'s argument).
        progress: show a progress bar on stderr.

    Returns a :class:`~tf32lab.report.generation.GenerationReport`; ``bool(report)`` is the verdict. Raises
    ``Tf32LabError`` for bad arguments or a model that raises in float64.

    Example (a plain causal model, token ids to logits):

        >>> import torch
        >>> class Tiny(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed, self.head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)
        ...     def forward(self, input_ids):
        ...         return self.head(self.embed(input_ids).cumsum(1))
        >>> report = check_generation(Tiny(), new_tokens=4, prompts=[[1, 2, 3]], levels=("highest", "high"))
        >>> [row.level for row in report.levels], len(report.reference_tokens[0])
        (['highest', 'high'], 4)
    """
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, numbers.Integral) or \
            not 1 <= new_tokens <= _MAX_NEW_TOKENS:
        raise Tf32LabError(f"new_tokens {new_tokens!r}: a whole number of tokens to generate, 1 to "
                           f"{_MAX_NEW_TOKENS}")
    new_tokens = int(new_tokens)  # a NumPy integer too
    # bool("no") was True; a NumPy bool is one (its type is numpy.bool in NumPy 2, numpy.bool_ in NumPy 1)
    if not isinstance(use_cache, bool) and not (type(use_cache).__module__ == "numpy"
                                                and type(use_cache).__name__ in ("bool", "bool_")):
        raise Tf32LabError(f"use_cache {use_cache!r}: True or False")
    if temperature != 0:
        raise Tf32LabError(f"temperature {temperature!r}: the generation check decodes greedily (temperature 0); "
                           f"sampling would make rows differ by chance, not by precision")
    levels = check_levels(levels)
    target = resolve_target(target)
    refuse_native_levels(levels, target)
    judge = Criterion.parse(criterion, new_tokens)
    decoder = _Decoder.of(workload)
    texts, batches = decoder.prompts(prompts)
    decoder.refuse_past_positions(batches, new_tokens)  # before the float64 row allocates a step of them
    decoder.refuse_past_memory(batches, new_tokens)
    if judge.kind == "perplexity" and all((b.ids.shape[1] if b.mask is None else int(b.mask.sum(1).max())) < 2
                                          for b in batches):
        # the loss is on the prompts' own text: no prompt of two tokens gives none, and every row failed
        raise Tf32LabError(f"criterion {judge.text!r} judges the loss on the prompts' own text, and no prompt has "
                           f"two tokens or more: give longer prompts, or a divergence or agreement criterion")
    with exits_refused(decoder.name, "check_generation"), kept_flags() as changed, experts_eager(decoder.model):
        report = _Generation(decoder, batches, texts, new_tokens, levels, target, judge, bool(use_cache),
                             accumulation, progress).run()
    said = workload.notes if isinstance(workload, CausalLM) else ()
    if said or changed:
        report = dataclasses.replace(report, notes=(*said, *report.notes,
                                                    *([changed_note(changed)] if changed else [])))
    return report


# -- the model and its prompts ----------------------------------------------------------------------------------
@dataclasses.dataclass
class _Batch:
    """Prompts decoded together: their places among all prompts, their ids (left-padded) and the mask (None: a
    model without one, every prompt of the batch the same length)."""

    where: list[int]
    ids: torch.Tensor
    mask: Optional[torch.Tensor]


class _Decoder:
    """One forward of a causal model: ``(ids, mask, cache) -> (logits, cache)``, a transformers model fed its
    attention mask, positions and cache, any other module ``ids`` alone."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, name: str) -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name
        config = getattr(model, "config", None)
        if getattr(config, "is_encoder_decoder", False) is True:  # T5 raised in float64, wanting decoder inputs
            kind = getattr(config, "model_type", None)
            raise Tf32LabError(f"model {name!r} is an encoder-decoder (model type {kind!r}); the generation "
                               f"check decodes a decoder-only causal language model (a module mapping "
                               f"input_ids [batch, seq] to logits [batch, seq, vocab]); check it with tf32lab.check()")
        check_float32(model, name)
        try:
            takes = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            takes = {}
        # transformers 5 names the cache argument ``cache``, earlier versions ``past_key_values``
        self.cache_arg = next((k for k in ("cache", "past_key_values") if k in takes), None)
        self.hf = self.cache_arg is not None and "attention_mask" in takes
        self.positions = self.hf and "position_ids" in takes
        self.mask_once = getattr(config, "model_type", None) in _MASK_AT_PREFILL
        self.unpadded = _padding_leaks(config)
        self.cacheless = False  # a forward with use_cache gave no cache back
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad = int(pad) if pad is not None else 0  # masked out: any id the embedding has
        self.ends = _end_tokens(model, tokenizer)
        self.vocab = embedding_rows(model)  # None: a module that does not say
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))

    @classmethod
    def of(cls, workload: Any) -> _Decoder:
        if isinstance(workload, CausalLM):
            return cls(workload.model, workload.tokenizer, workload.name)
        if isinstance(workload, torch.nn.Module):
            return cls(workload, None, type(workload).__name__)
        raise Tf32LabError(f"check_generation() takes a causal language model (tf32lab.workloads.hf.causal_lm(), or "
                           f"a module mapping input_ids [batch, seq] to logits [batch, seq, vocab]), not "
                           f"{type(workload).__name__}")

    def prompts(self, prompts: Optional[Sequence[Any]]) -> tuple[tuple[str, ...], list[_Batch]]:
        """The prompts as shown, and as batches of token ids."""
        if prompts is None:
            if self.tokenizer is None:
                raise Tf32LabError(f"model {self.name!r} has no tokenizer: give prompts as lists of token ids")
            prompts = list(DEFAULT_PROMPTS)
        if _array(prompts):  # a tensor or a NumPy array: one prompt (1-D) or a batch (2-D), as a tensor is read
            prompts = prompts.tolist() if prompts.ndim == 2 else [prompts.tolist()]
        if not isinstance(prompts, str) and isinstance(prompts, Iterable) and not isinstance(prompts, Sequence):
            prompts = list(prompts)  # a generator: len() raised TypeError
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not len(prompts):
            raise Tf32LabError(f"prompts {prompts!r}: a non-empty list of texts or of token-id lists")
        ids: list[list[int]] = []
        shown: list[str] = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise Tf32LabError(f"prompt {i + 1} is text, and model {self.name!r} has no tokenizer: give "
                                       f"token ids")
                try:
                    found = _prompt_ids(self.tokenizer, prompt)
                except Exception as exc:  # a lone surrogate raised the tokenizer's TypeError, naming no prompt
                    raise Tf32LabError(f"prompt {i + 1} ({prompt[:60]!r}): the tokenizer cannot take it "
                                       f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                                       ) from None
                shown.append(prompt)
            elif isinstance(prompt, (bytes, bytearray, memoryview)):
                # a sequence of whole numbers, and read as token ids: b"hi" was [104, 105]
                raise Tf32LabError(f"prompt {i + 1} ({bytes(prompt)[:60]!r}) is bytes: give text (decoded) or a list "
                                   f"of token ids")
            else:
                try:  # operator.index: a token id 1.7 is no id (int() made it 1)
                    found = [operator.index(t) for t in (prompt.tolist() if _array(prompt) else prompt)]
                except (TypeError, ValueError):
                    raise Tf32LabError(f"prompt {i + 1} ({prompt!r}): a text or a list of token ids (whole "
                                       f"numbers)") from None
                shown.append(" ".join(map(str, found)))  # decoded below, once every id is in range
            if not found:
                raise Tf32LabError(f"prompt {i + 1} ({shown[-1]!r}) has no tokens")
            # an id the embedding lacks raised "index out of range in self" at the float64 reference, naming no prompt
            bad = next((t for t in found if not 0 <= t < (2 ** 63 if self.vocab is None else self.vocab)), None)
            if bad is None and not isinstance(prompt, str) and self.tokenizer is not None:
                # only now: decode() of a negative or huge id raised OverflowError, of one past the vocabulary gave ''
                shown[-1] = self.tokenizer.decode(found)
            if bad is not None:
                has = f"0 to {self.vocab - 1}, its input embeddings" if self.vocab is not None else \
                    "0 or more" if bad < 0 else "below 2**63 (int64)"
                raise Tf32LabError(f"prompt {i + 1} ({shown[-1][:60]!r}) has token id {bad}; model {self.name!r} "
                                   f"takes ids {has}")
            ids.append(found)
        return tuple(shown), self._batches(ids)

    def refuse_past_memory(self, batches: list[_Batch], n: int) -> None:
        """Refuses prompts and ``n`` whose logits cannot fit in the memory available, before any forward: the
        float64 row keeps its teacher-forced logits of every new token (``[prompts, n, vocab]`` in float64) for
        every row to compare with, and each teacher-forced forward gives the logits of the whole sequence. At a
        large vocabulary this dwarfs a small model (8 prompts, 1024 new tokens and Qwen2's 151936 ids: 10 GB kept,
        as much again at the float64 forward), and the operating system's out-of-memory killer ends a process
        without a line."""
        if self.vocab is None:
            return
        free = _available_bytes(self.device)
        need = sum(len(b.where) * (b.ids.shape[1] + 2 * n) for b in batches) * self.vocab * 8
        if free is None or need <= free:
            return
        prompts = sum(len(b.where) for b in batches)
        raise Tf32LabError(f"{prompts} prompts and {n} new tokens over model {self.name!r}'s vocabulary of "
                           f"{self.vocab} need about {need / 2**30:.1f} GiB for the logits the check compares "
                           f"(float64's kept for every row), more than the {free / 2**30:.1f} GiB available on "
                           f"{self.device.type}: give fewer new tokens or fewer prompts")

    def refuse_past_positions(self, batches: list[_Batch], n: int) -> None:
        """Refuses prompts that, with ``n`` new tokens, run past the model's position table: an absolute-position
        decoder (GPT-2) indexes past it and raises, a rotary one (Llama) runs on at positions it never learnt,
        the float64 row's memory growing with the length (a 15k-token prompt on a two-layer Llama took 7.6 GB
        before anything was said). The last new token is never fed: ``longest + n - 1`` positions."""
        found = _positions(getattr(self.model, "config", None))
        if found is None:
            return
        limit, said = found
        longest, which = max(((int(b.ids.shape[1] if b.mask is None else b.mask[row].sum()), where)
                              for b in batches for row, where in enumerate(b.where)), key=lambda found: found[0])
        if longest + n - 1 <= limit:
            return
        hint = f"give at most {limit - longest + 1} new tokens, or shorter prompts" if longest <= limit else \
            f"give prompts of at most {limit - n + 1} tokens" if n <= limit else \
            "give fewer new tokens and shorter prompts"
        raise Tf32LabError(f"prompt {which + 1} ({longest} tokens, the longest) and {n} new tokens need "
                           f"{longest + n - 1} positions; model {self.name!r} has {limit} ({said}): {hint}")

    def _batches(self, ids: list[list[int]]) -> list[_Batch]:
        if self.hf and not self.unpadded:  # one batch, left-padded: new tokens follow each prompt's last token
            longest = max(map(len, ids))
            rows = [[self.pad] * (longest - len(p)) + p for p in ids]
            mask = [[0] * (longest - len(p)) + [1] * len(p) for p in ids]
            return [_Batch(list(range(len(ids))), torch.tensor(rows, device=self.device),
                           torch.tensor(mask, device=self.device))]
        groups: dict[int, list[int]] = {}  # no padding: prompts of one length together
        for i, p in enumerate(ids):
            groups.setdefault(len(p), []).append(i)
        batches = [_Batch(where, torch.tensor([ids[i] for i in where], device=self.device), None)
                   for where in groups.values()]
        if self.hf:  # a transformers model is still fed its mask (all ones) and positions
            for batch in batches:
                batch.mask = torch.ones_like(batch.ids)
        return batches

    def __call__(self, ids: torch.Tensor, mask: Optional[torch.Tensor], cache: Any,
                 use_cache: bool) -> tuple[torch.Tensor, Any]:
        """Logits ``[batch, len(ids), vocab]`` of the positions fed (the last ones of ``mask``), and the cache."""
        if not self.hf:
            out = self.model(ids)
        else:
            step = use_cache and cache is not None
            kwargs: dict[str, Any] = {"attention_mask": None if step and self.mask_once else mask,
                                      "use_cache": use_cache}
            if self.positions:  # left padding: a prompt's first real token is at position 0
                kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
            if step:
                kwargs[self.cache_arg] = cache
            out = self.model(input_ids=ids, **kwargs)
        # Released after every forward: pooled by size class, a decoder's steps would take the same buffers again,
        # but the pool keeps every class a forward used (the teacher-forced forward's largest ones too), and the
        # rows' peak memory measured higher with it kept (benchmarks/generation.py) than with it released.
        release_buffers()
        logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
        if logits is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            logits = out[0]
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != ids.shape:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(out).__name__
            raise Tf32LabError(f"model {self.name!r} is not a causal language model: fed input_ids of shape "
                               f"{tuple(ids.shape)}, it gave {got}, not logits [batch, seq, vocab]")
        if not use_cache or not self.hf:
            return logits, None
        cache = getattr(out, "cache", None)
        # transformers 4 names it past_key_values; in 5 that name is a property that logs its deprecation
        if cache is None and not isinstance(getattr(type(out), "past_key_values", None), property):
            cache = getattr(out, "past_key_values", None)
        if cache is None:  # a model that keeps its state in its modules (RecurrentGemma): each step reads it all
            self.cacheless = True
        return logits, cache


# -- one row ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Run:
    tokens: list[list[int]]  # per prompt
    step_logits: list[torch.Tensor]  # per batch: [b, new_tokens, vocab], teacher-forced
    loss_sum: float
    loss_count: int


def _greedy(decoder: _Decoder, batch: _Batch, n: int, use_cache: bool,
            reference: Optional[torch.Tensor], ends: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[b, <= n]`` greedy tokens; with ``reference`` (float64's ``[b, n]``) and ``ends`` (its text's length per
    prompt), it stops once every prompt has left it or reached the end of float64's text."""
    seq, mask, cache = batch.ids, batch.mask, None
    found: list[torch.Tensor] = []
    left = torch.zeros(seq.shape[0], dtype=torch.bool, device=seq.device)
    for step in range(n):
        fed = seq[:, -1:] if use_cache and cache is not None else seq
        logits, cache = decoder(fed, mask, cache, use_cache)
        token = logits[:, -1].argmax(-1)
        found.append(token)
        if reference is not None:
            left |= token != reference[:, step]
            if bool((left | (ends <= step + 1)).all()):
                break
        seq = torch.cat([seq, token[:, None]], dim=1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return torch.stack(found, dim=1)


def _forced(decoder: _Decoder, batch: _Batch, reference: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """One forward over the prompt and float64's tokens: the logits of each new token ``[b, n, vocab]``, and the
    summed token loss (and count) on the prompts' own text."""
    n, length = reference.shape[1], batch.ids.shape[1]
    ids = torch.cat([batch.ids, reference[:, :-1]], dim=1)
    mask = None if batch.mask is None else torch.cat([batch.mask, torch.ones_like(reference[:, :-1])], dim=1)
    logits, _ = decoder(ids, mask, None, False)
    own = logits[:, :length - 1].double()
    if own.shape[1]:
        losses = torch.nn.functional.cross_entropy(own.reshape(-1, own.shape[-1]), batch.ids[:, 1:].reshape(-1),
                                                   reduction="none").view(own.shape[:2])
        counted = torch.ones_like(losses, dtype=torch.bool) if batch.mask is None else \
            (batch.mask[:, 1:] * batch.mask[:, :-1]).bool()
        total, count = float(losses[counted].sum()), int(counted.sum())
    else:
        total, count = 0.0, 0
    # a copy: a view would hold the logits of the whole sequence (the prompt's too) until the check ends
    return logits[:, length - 1:length - 1 + n].clone(), total, count


class _Generation:
    def __init__(self, decoder: _Decoder, batches: list[_Batch], texts: tuple[str, ...], n: int,
                 levels: tuple[str, ...], target: Target, criterion: Criterion, use_cache: bool,
                 accumulation: Optional[str], progress: bool) -> None:
        self.decoder, self.batches, self.texts, self.n = decoder, batches, texts, n
        self.levels, self.target, self.criterion, self.use_cache = levels, target, criterion, use_cache
        self.accumulation, self.progress = check_accumulation(accumulation), progress
        self.notes: list[str] = []
        self.families: set[Optional[str]] = set()  # the op families the emulated rows met

    def run(self) -> GenerationReport:
        started = time.perf_counter()
        alike = alike_levels(("highest", *[lv for lv in self.levels if lv != "highest"]), self.target)
        measured = [lv for lv in self.levels if lv != "highest" and alike[lv] is None]
        model = self.decoder.model
        training = training_note(model)  # before eval_mode: what came in training mode, said as check says it
        if training:
            self.notes.append(training)
        with Progress(self.progress, steps=2 + len(measured)) as bar, \
                Streams(cuda_devices(model), "check_generation") as streams, eval_mode(model), \
                state_kept(model) as reset, torch.no_grad():
            self.streams, self.reset = streams, reset
            bar.step(f"{self.decoder.name}: float64, {self.n} tokens x {len(self.texts)} prompts")
            self.reference = self._reference()
            rows: dict[str, GenerationLevel] = {}
            for level in measured:
                bar.step(f"{level}: {self.n} tokens x {len(self.texts)} prompts")
                rows[level] = self._row(level)
            bar.step(f"highest: float32's own, {self.n} tokens")
            floor = self._row("highest", label=FLOOR)
        rows_of_alike(self.levels, alike, rows, floor)
        if self.reset.changed:
            self.notes.append(stateful_note(self.reset.changed))
        if self.reset.written:
            self.notes.append(written_note(self.reset.written))
        if (not self.decoder.hf or self.decoder.cacheless) and self.use_cache:
            self.notes.append(f"model {self.decoder.name!r} takes no key/value cache: every step ran the whole "
                              f"sequence")
        unapplied = _unapplied(model)
        if unapplied is not None:
            self.notes.append(unapplied)
        if self.reference_count == 0:
            self.notes.append("no prompt has two tokens or more: there is no loss on the prompts' own text")
        ended = [i for i, end in enumerate(self.ends) if end < self.n]
        if ended:
            steps = ", ".join(f"{self.ends[i]}" for i in ended[:8]) + (", ..." if len(ended) > 8 else "")
            self.notes.append(f"float64's text ends (an end-of-text token) before {self.n} new tokens on "
                              f"{len(ended)} of {len(self.texts)} prompts (at step {steps}): each row's tokens are "
                              f"compared up to there, as generate() stops there")
        ref = self.reference
        return GenerationReport(
            workload=self.decoder.name, target=self.target.name, new_tokens=self.n, prompts=self.texts,
            criterion=self.criterion, use_cache=self.use_cache,
            reference_tokens=tuple(tuple(t) for t in ref.tokens), reference_loss=self._loss(ref), floor=floor,
            reference_ends=tuple(self.ends),
            levels=tuple(rows[level] for level in self.levels),
            environment=environment_of(Workload(model, torch.zeros(0), name=self.decoder.name)),
            seconds=time.perf_counter() - started, notes=tuple(self.notes))

    def _fresh(self) -> None:
        self.reset()  # every row from the state the model had (its buffers, attributes it sets)
        release_buffers()  # the emulator's scratch of the last row: memory the next need not hold
        self.streams.seeded()

    def _decode(self, references: Optional[list[torch.Tensor]]) -> _Run:
        tokens: list[list[int]] = [[] for _ in self.texts]
        step_logits, total, count = [], 0.0, 0
        for k, batch in enumerate(self.batches):
            ref = None if references is None else references[k]
            ends = None if references is None else self.ref_ends[k]
            found = _greedy(self.decoder, batch, self.n, self.use_cache, ref, ends)
            for row, i in enumerate(batch.where):
                tokens[i] = found[row].tolist()
            forced, loss, counted = _forced(self.decoder, batch, found if ref is None else ref)
            step_logits.append(forced)
            total, count = total + loss, count + counted
        return _Run(tokens, step_logits, total, count)

    def _reference(self) -> _Run:
        self._fresh()
        try:
            with Float64Run(on_write=self.reset.before_write):  # a parameter it writes into: copied, put back
                run = self._decode(None)
        except (Tf32LabError, KeyboardInterrupt):
            raise
        except BaseException as exc:  # sys.exit() included: bad input, never a check without a verdict
            if out_of_memory(exc):
                raise Tf32LabError(f"model {self.decoder.name!r}: out of memory at the float64 reference: "
                                   f"{described(exc)}") from exc
            bug = internal_error(exc, f"running model {self.decoder.name!r} in float64")
            if bug is not None:
                raise bug from exc
            raise Tf32LabError(f"model {self.decoder.name!r} raised in float64, before any level ran: "
                               f"{described(exc)}") from exc
        self.reference_count = run.loss_count
        self.ref_ids = [torch.tensor([run.tokens[i] for i in b.where], device=self.decoder.device)
                        for b in self.batches]
        # where float64's text ends, per prompt: its first end-of-text token, counted (else all n)
        self.ends = [next((s + 1 for s, t in enumerate(tokens) if t in self.decoder.ends), self.n)
                     for tokens in run.tokens]
        self.ref_ends = [torch.tensor([self.ends[i] for i in b.where], device=self.decoder.device)
                         for b in self.batches]
        return run

    def _loss(self, run: _Run) -> float:
        return run.loss_sum / run.loss_count if run.loss_count else math.nan

    def _row(self, level: str, label: Optional[str] = None) -> GenerationLevel:
        started = time.perf_counter()
        self._fresh()
        maths = self.target.maths_at(level, context_cells()) if self.target.emulated else {}
        native = self.target if label != FLOOR or not self._ieee_at_highest() else resolve_target("native")
        emu = None
        try:
            with level_context(level, native, self.accumulation) as emu:
                run = self._decode(self.ref_ids)
            release_buffers()  # the rounded weights the block gave back: no later row or caller needs them
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # sys.exit() included: a row that raises is a finding
            release_buffers()
            if isinstance(exc, Tf32LabError) and "not a causal language model" in str(exc):
                raise
            bug = internal_error(exc, f"running model {self.decoder.name!r} at {level!r}")
            if bug is not None:
                raise bug from exc
            n = len(self.texts)
            return GenerationLevel(label or level, maths, tuple(() for _ in range(n)), tuple([1] * n), 0.0,
                                   tuple([math.inf] * self.n), math.nan, math.nan, math.nan, False,
                                   _counts(emu, "coverage"), _counts(emu, "unhandled"),
                                   time.perf_counter() - started, failure=described(exc))
        if emu is not None:
            self.families |= families_met(emu)
        ref = self.reference
        divergence = tuple(next((s + 1 for s, (a, b) in enumerate(zip(mine[:end], theirs[:end])) if a != b), None)
                           for mine, theirs, end in zip(run.tokens, ref.tokens, self.ends))
        agree, errors = 0, torch.zeros(self.n, dtype=torch.float64)
        for forced, reference, ends in zip(run.step_logits, ref.step_logits, self.ref_ends):
            within = torch.arange(self.n, device=ends.device)[None, :] < ends[:, None]  # float64's text
            # float64's top-1 on the same input, not its greedy token: the two part where a forward over the whole
            # sequence computes otherwise than the cached steps (dynamic rotary scaling, rescaled by the length)
            agree += int(((forced.argmax(-1) == reference.argmax(-1)) & within).sum())
            for mine, theirs, end in zip(forced, reference, ends.tolist()):  # a prompt at a time: one [n, vocab]
                wide = mine[:end].double()  # float64's text: no step after its end-of-text token is a user's
                # equal logits differ by 0: a vocabulary masked to -inf in both gave inf - inf = nan at every step
                gap = torch.where(wide == theirs[:end], torch.zeros_like(wide), (wide - theirs[:end]).abs())
                errors[:end] = torch.maximum(errors[:end], gap.amax(dim=1).cpu())
        loss = self._loss(run)
        change = loss - self._loss(ref)
        row = GenerationLevel(
            label or level, maths, tuple(tuple(t) for t in run.tokens), divergence,
            agree / sum(self.ends), tuple(errors.tolist()), loss, change,
            math.expm1(change) if math.isfinite(change) else math.nan, False, _counts(emu, "coverage"),
            _counts(emu, "unhandled"), time.perf_counter() - started)
        return dataclasses.replace(row, passed=self.criterion.passes(row))


    def _ieee_at_highest(self) -> bool:
        """Whether float32's floor may run natively (``precision("highest")``, no emulator): the emulated rows
        ran, and every op family they met computes IEEE at ``highest`` on the target, summed as this machine sums
        (``ideal`` accumulation). The same math, without the emulator's per-op dispatch, which costs more than a
        small decoder's step."""
        if not self.target.emulated or not self.families or None in self.families or \
                self.accumulation != "ideal":
            return False
        maths = self.target.maths_at("highest", context_cells())
        return all(m == "ieee" for key, m in maths.items() if key.split(".")[0] in self.families)


def _array(value: Any) -> bool:
    """Whether ``value`` is a tensor or an array (NumPy's): read as a tensor is, one prompt a row; not bytes, whose
    ``memoryview`` has dimensions too (bytes are refused as prompts)."""
    return isinstance(value, torch.Tensor) or (
        not isinstance(value, (bytes, bytearray, memoryview)) and isinstance(getattr(value, "ndim", None), int)
        and callable(getattr(value, "tolist", None)))


def _padding_leaks(config: Any) -> bool:
    """Whether the decoder's prompts, left-padded in one batch, write other tokens than each alone whatever the mask
    says (a padded batch of ``generate()`` too): they are then decoded in batches of one length, unpadded.
    RecurrentGemma's recurrent block runs its temporal convolution over every position fed, with no mask
    (transformers' modeling_recurrent_gemma.py, ``RecurrentGemmaRecurrentBlock.forward``). MiniMax's cache keeps a
    linear-attention layer's state apart and leaves it an empty key/value layer (modeling_minimax.py,
    ``MiniMaxCache``), which masking_utils.py's ``find_first_full_attention_index`` takes for a full-attention one
    when it is layer 0: each cached step sized the full-attention layers' mask by a layer that holds no keys."""
    kind, layers = getattr(config, "model_type", None), getattr(config, "layer_types", None) or [None]
    return kind == "recurrent_gemma" or (kind == "minimax" and layers[0] == "linear_attention")


def _prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids as a user's ``model.generate(**tokenizer(text))`` sees them, with the special tokens the
    tokenizer puts before the text (a Llama tokenizer's beginning-of-text token; a GPT-2's adds none), less those
    it appends after the text (an end-of-text or separator token: a Llama tokenizer with ``add_eos_token``, a BERT
    tokenizer's ``[SEP]``). A prompt is a text to continue: ending in its end-of-text token, every row wrote a new
    text after it, and the prompts' loss took in a prediction of their end."""
    # transformers' tokenizers warn of a text past their model_max_length ("will result in indexing errors"): the
    # model's positions are what a prompt must fit, refused in one line of the check's own before any row
    quiet = quiet_loading() if type(tokenizer).__module__.startswith("transformers.") else contextlib.nullcontext()
    with quiet:
        try:
            encoded = tokenizer(text, return_special_tokens_mask=True)
        except TypeError:  # a tokenizer of the user's own that takes no such argument
            return list(tokenizer(text)["input_ids"])
    ids, special = list(encoded["input_ids"]), encoded.get("special_tokens_mask")
    if special is None or len(special) != len(ids) or all(special):
        return ids
    end = max(i for i, flag in enumerate(special) if not flag) + 1
    return ids[:end]


def _available_bytes(device: torch.device) -> Optional[int]:
    """The memory a new tensor on ``device`` can take: CUDA's free memory and what PyTorch's caching allocator
    holds unused (reserved, not allocated: mem_get_info counts it as taken, yet a new tensor takes it first), or
    Linux's ``MemAvailable`` (what can be allocated without swapping); None where neither says."""
    try:
        if device.type == "cuda":
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            return int(torch.cuda.mem_get_info(device)[0]) + max(0, int(cached))
        if device.type == "cpu":
            with open("/proc/meminfo", encoding="ascii") as info:
                for line in info:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
    except (OSError, ValueError, RuntimeError):
        return None
    return None


def _positions(config: Any) -> Optional[tuple[int, str]]:
    """How many positions a transformers decoder has, and the config field that says so: GPT-2's ``n_positions``,
    else ``max_position_embeddings``; a scaled rotary embedding (linear, YaRN, LongRoPE) reaches ``factor`` times
    its original length, and a dynamic one (NTK-aware, rescaled as the sequence grows) has no limit; None where
    the config says none (ALiBi models, a Falcon's ``alibi=True`` among them; plain modules)."""
    if config is None:
        return None
    if callable(getattr(config, "get_text_config", None)):
        config = config.get_text_config()
    if getattr(config, "alibi", False) is True:
        # ALiBi's biases are made for any length (Press et al., 2022): Falcon's max_position_embeddings beside
        # alibi=True sizes no table, and a falcon-rw model runs past it (refused, it was valid input)
        return None
    field, limit = next(((name, found) for name, found in ((name, getattr(config, name, None)) for name in
                         ("n_positions", "max_position_embeddings"))
                         if isinstance(found, int) and not isinstance(found, bool) and found > 0), (None, None))
    if limit is None:
        return None
    # transformers 5 names the rotary embedding's settings rope_parameters, earlier versions rope_scaling
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    kind = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else None
    if kind == "dynamic":
        return None
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if kind not in (None, "default") and isinstance(factor, (int, float)) and factor > 1:
        original = rope.get("original_max_position_embeddings") or limit
        if isinstance(original, int) and original * factor > limit:
            return int(original * factor), f"{original} x {factor:g}, its {kind} rotary scaling"
    return limit, f"config.{field}"


# generate()'s settings that change which token it writes (logits processors, beams, sampling), and the value at
# which each changes nothing: a model's generation_config.json that sets one makes generate() write other tokens
# than the raw greedy top-1 this check compares
_NEUTRAL: dict[str, Any] = {"do_sample": False, "num_beams": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                            "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0,
                            "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
                            "forced_bos_token_id": None, "forced_eos_token_id": None, "min_length": 0,
                            "min_new_tokens": 0, "sequence_bias": None, "penalty_alpha": None,
                            "exponential_decay_length_penalty": None, "guidance_scale": 1.0, "dola_layers": None,
                            "watermarking_config": None}


def _unapplied(model: torch.nn.Module) -> Optional[str]:
    """A note naming the settings of the model's generation config that ``generate()`` applies and the check does
    not: it decodes by the raw top-1 of the logits, so a model that ships a ``repetition_penalty`` (or forced
    tokens, a ban on repeated n-grams, beams, sampling) writes other text through ``generate()``; said, not
    silently measured as if it were that text."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return None
    found = []
    for name, neutral in _NEUTRAL.items():
        value = getattr(config, name, None)
        if value is not None and value != neutral and value != [] and value != {}:
            found.append(f"{name}={value!r}")
    if not found:
        return None
    return (f"the model's generation config sets {', '.join(found)}, which generate() applies and this check does "
            f"not: every row decodes by the raw greedy top-1 of the logits, so its tokens are the model's own, not "
            f"those generate() writes with these settings")


def _end_tokens(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    """The tokens that end a text: the tokenizer's end-of-sequence token and those of the model's generation config
    (what ``generate()`` stops at); none for a plain module without either."""
    found: set[int] = set()
    for said in (getattr(tokenizer, "eos_token_id", None),
                 getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        for token in said if isinstance(said, (list, tuple, set, frozenset)) else (said,):
            if isinstance(token, int) and not isinstance(token, bool) and token >= 0:
                found.add(token)
    return frozenset(found)


def _counts(emu: Any, what: str) -> dict[str, int]:
    """The emulator's ``coverage`` (``"op math"``) or ``unhandled`` (``"op"``) counts of a row."""
    if emu is None:
        return {}
    found = getattr(emu, what)
    return {" ".join(k) if isinstance(k, tuple) else k: n for k, n in sorted(found.items())}
