"""The reference run's layers: which modules are layers, their float64 outputs, and the error each one introduces
(rerun in float32 at each level on its own reference inputs) and accumulates (in an end-to-end run).

A *layer* is a module that runs matmul-family ops itself. :class:`Recorder` hooks every layer during the float64
reference run, keeps its outputs (spilled to disk when large) and reruns it at each measured level right after each
call (and a layer a policy pins to another cuDNN conv math, at its level and that math too, where the call runs
cuDNN's ops); :class:`Accumulated` compares each layer's outputs in an end-to-end run with the kept ones.

Example:

    >>> import torch, tf32lab
    >>> from tf32lab.measure.layers import hookable
    >>> [name for name, _ in hookable(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))[0]]
    ['(model)', '0', '1']
"""

from __future__ import annotations

import collections
import contextlib
import copy
import math
import sys
import warnings
from typing import Any, Callable, Optional

import torch

from tf32lab.control import modestack
from tf32lab.control.scope import conv_math, precision
from tf32lab.emulation.emulator import REUSED, context_cells, emulate
from tf32lab.emulation.reuse import Handoff, alike, computed_alike
from tf32lab.errors import Tf32LabError
from tf32lab.know import optable
from tf32lab.know.targets import PROJECTED, Target
from tf32lab.measure.choices import Kept
from tf32lab.measure.draws import Streams, random_op
from tf32lab.measure.given import Held, Narrowed, versions
from tf32lab.measure.norms import bare, reference_norm2, scratch, tree_normwise
from tf32lab.measure.own_hooks import OwnHooks, unwrapped
from tf32lab.measure.reference import Float64Run, storage_address, widen
from tf32lab.measure.sharded import local
from tf32lab.measure.spill import Spilled, SpillFile
from tf32lab.measure.state import KeptState
from tf32lab.numbers.origin import exit_call, internal_error
from tf32lab.numbers.trees import map_tensors, named_leaves, named_tensors
from tf32lab.report.conclusion import NO_TENSOR, UNMEASURED
from tf32lab.speed.counting import ROOT, Counting
from tf32lab.workloads.workload import Workload

_OUT_OF_MEMORY = (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says memory ran out: a MemoryError, CUDA's OutOfMemoryError, or the CPU allocator's
    RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(exc, _OUT_OF_MEMORY) or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def described(exc: BaseException) -> str:
    """``LinAlgError: linalg.cholesky: ...``: the exception's public name and its message, on one line (of a
    TorchScript traceback, its first and last lines); a ``SystemExit`` as the call that raised it,
    ``SystemExit: sys.exit(0) was called``."""
    if isinstance(exc, SystemExit):  # its message is its bare code: "SystemExit: 0" would say nothing
        return f"SystemExit: {exit_call(exc)} was called"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] + (f" … {lines[-1]}" if len(lines) > 1 else "") if lines else ""
    name = type(exc).__name__.lstrip("_")
    return f"{name}: {text}" if text else name


@contextlib.contextmanager
def level_context(level: str, target: Target, accumulation: Optional[str] = None, weight_cache: bool | str = True,
                  handoff: Optional[Handoff] = None):
    if not target.emulated:
        with precision(level):
            yield None
    else:  # emulate() first: a scope inside it never writes the flag (a level this torch cannot set, bfx9, runs)
        with emulate(target, accumulation=accumulation, weight_cache=weight_cache, handoff=handoff) as emu, \
                precision(level):
            yield emu




_MISSING = object()
_OBJECTS = (torch.distributions.Distribution, torch.distributions.Transform)
_ANSWERED = (torch.Tensor, Spilled, *_OBJECTS)  # what a nested layer's answer narrows to float32


# -- the reference run: which modules are layers, their outputs, the error each introduces -----------------------
def hookable(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Module]], list[str]]:
    """The modules of ``model`` that take hooks, and the TorchScript ones that do not (nor do their insides)."""
    found, scripted = [], []
    script = torch.jit.ScriptModule
    for name, module in model.named_modules():
        if any(name == s or name.startswith(s + ".") or s == ROOT for s in scripted):
            continue
        if isinstance(module, script):
            scripted.append(name or ROOT)
            continue
        found.append((name or ROOT, module))
    return found, scripted


@contextlib.contextmanager
def float64_scripted(workload: Workload, recorder: Recorder):
    """The model to run for the reference: TorchScript parts swapped for float64 copies of them (a ScriptModule
    checks dtypes where no mode can widen), put back afterwards (and for every float32 rerun)."""
    model = workload.model
    if ROOT in recorder.scripted:
        yield _scripted_twin(model, workload.name, ROOT)
        return
    swapped = recorder.swapped
    try:
        for name in recorder.scripted:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            original = parent._modules[child]
            twin = _scripted_twin(original, workload.name, name)
            parent._modules[child] = twin
            swapped.append((parent, child, original, twin))
        yield model
    finally:
        for parent, child, original, _ in reversed(swapped):
            parent._modules[child] = original
        swapped.clear()


@contextlib.contextmanager
def _originals(swapped: list):
    """The float32 TorchScript parts back in place while a layer reruns in float32."""
    for parent, child, original, _ in swapped:
        parent._modules[child] = original
    try:
        yield
    finally:
        for parent, child, _, twin in swapped:
            parent._modules[child] = twin


def _scripted_twin(module: torch.nn.Module, workload: str, name: str) -> torch.nn.Module:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ScriptModule.double() reads .grad of its parameters
            twin = copy.deepcopy(module)
            return twin.to(torch.float64)
    except Exception as exc:
        raise Tf32LabError(f"workload {workload!r}: the TorchScript module {name!r} cannot be copied to float64 "
                           f"for the reference: {type(exc).__name__}: {exc}") from exc


# functorch's interpreter stack, looked up once: every module call of the reference run asks (None on a torch
# without it)
_PEEK_TRANSFORM = getattr(torch._C._functorch, "peek_interpreter_stack", None)


def transformed() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp) is running: a module called inside one is given wrapped
    tensors, which cannot be read out (``.item()`` raises) nor kept for its reruns outside the transform."""
    return _PEEK_TRANSFORM is not None and _PEEK_TRANSFORM() is not None


class _Frame:
    """A module call in progress in the reference run."""

    __slots__ = ("args", "drew", "families", "held", "inner", "kwargs", "name", "ran", "state", "versions")

    def __init__(self, name: str, args: tuple, kwargs: dict, state: Any = None) -> None:
        self.name, self.args, self.kwargs, self.ran = name, args, kwargs, False
        self.state, self.drew = state, False  # the random streams' state at the call, and whether it drew
        self.families: set[str] = set()  # the op families this call ran itself (not its nested layers')
        self.versions = versions((args, kwargs))
        self.held = Held.among((args, kwargs))  # the objects it is given (a cache), as they were
        self.inner: list[tuple[str, int]] = []  # layer calls made inside this one: (name, call index)


# op overload -> (whether it draws, its family): known once per overload, for the reference run tells the recorder of
# every op it runs
_OPS: dict[Any, tuple[bool, Optional[str]]] = {}


class Recorder:
    """Hooks and a float64 mode for the reference run (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, levels: list[str], target: Target,
                 spill: Optional[SpillFile] = None, accumulation: Optional[str] = None, ranks: Any = None,
                 pins: Optional[dict[str, tuple[str, str]]] = None) -> None:
        self.model, self.levels, self.target = model, levels, target
        # layer -> (level, conv math) a policy runs it at, where that math computes its cuDNN ops otherwise: each
        # call that runs some (conv, rnn) is rerun there too
        self.pins = pins or {}
        self.ranks = ranks  # measure.sharded.Ranks of a sharded check: each call's error summed over the ranks
        self.accumulation = accumulation  # emulate()'s: None for the TF32LAB_ACCUMULATION setting
        self.spill = spill or SpillFile()
        self.modules, self.scripted = hookable(model)
        # told of each op and write only while the recorder is entered (:meth:`__enter__`): its callbacks are the
        # recorder's own methods, and a recorder held by its mode outlived every error raised before its release
        self.mode = Float64Run()
        self.mode.choices = Kept()  # the reference's choices (top-k, argmax), for the rows' (measure.choices)
        self.before_write: Optional[Callable[[list[torch.Tensor]], None]] = None  # the model's state's copy-on-write
        self.shared: dict[int, list[tuple[str, int]]] = {}  # storage address -> outputs kept without a copy
        self.stack: list[_Frame] = []
        self.outputs: dict[tuple[str, int], tuple[Any, dict[str, float]]] = {}  # float64 output, each ‖r‖²
        self.count: dict[str, int] = {}  # calls per layer
        self.layers: list[tuple[str, torch.nn.Module]] = []  # in the order they first ran
        self.introduced: dict[str, dict[str, tuple[float, Optional[str]]]] = {level: {} for level in levels}
        self.pinned: dict[str, tuple[float, Optional[str]]] = {}  # pinned layer -> its worst error at its pin
        self.handles: list = []
        self.rerunning = False
        self.scratch: Optional[torch.Tensor] = None
        self.swapped: list = []  # (parent, name, float32 original, float64 twin) of TorchScript parts
        self.model_inputs: set[int] = set()  # ids of the (widened) workload inputs
        self.as_accumulated: set[tuple[str, int]] = set()  # calls whose introduced error is their accumulated one
        self.family_ops = 0  # matmul-family ops the reference saw on this thread (not another's: see OtherThreads)
        # whether the model turned autograd on inside the reference run (which runs under no_grad): a forward that
        # differentiates (torch.enable_grad() and autograd.grad) cannot run under inference mode, where nothing
        # is recorded, so the rows and reruns then run under no_grad as the reference did (:meth:`grad_mode`)
        self.grad_used = False
        self.families: dict[str, set[str]] = {}  # layer -> the op families of its own ops (conv, rnn, ...)
        self.called: set[str] = set()  # the modules whose forward ran (one whose parent uses its weights did not)
        self.transformed: list[str] = []  # modules called inside a torch.func transform: not measured as layers
        self.by_family: collections.Counter[str] = collections.Counter()  # the reference's family ops, per family
        self.rnn_ops: set[str] = set()  # the reference's RNN ops by name (aten::lstm, aten::gru, ...)
        self.streams: Optional[Streams] = None  # set by check: each rerun draws from its call's random state
        self.quiet: list[Any] = []  # the caller's own modes over the reference run, lifted while a layer reruns
        self.alike: dict[tuple[str, str], frozenset[str]] = {}  # two levels -> the families computed alike
        self.narrowed = Narrowed()  # the float32 copies of the float64 tensors in the objects reruns are given
        self.own_hooks: Optional[OwnHooks] = None  # the model's own forward hooks, while it records

    def __enter__(self) -> Recorder:
        try:
            for name, module in self.modules:
                # first of the module's pre-hooks: a call's inputs as it was given them, which its reruns run the
                # module's own pre-hooks on again (taken after them, a hook that shifts its input shifted it twice)
                self.handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True,
                                                                     prepend=True))
                self.handles.append(module.register_forward_hook(self._post(name, module), with_kwargs=True))
            self.handles += _around_sharding(self.model, self.mode)
            if self.levels or self.pins:  # layers rerun in this pass: the model's own hooks watched around them
                self.own_hooks = OwnHooks([m for _, m in self.modules], {h.id for h in self.handles},
                                          lambda: self.rerunning).__enter__()
            self.mode.on_op, self.mode.on_write = self._op, self._written
            self.mode.__enter__()
        except BaseException:
            self.mode.on_op = self.mode.on_write = None
            self._unhook()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.mode.__exit__(*exc)
        finally:
            self.mode.on_op = self.mode.on_write = None  # no cycle: dropped, the recorder goes with what it keeps
            self._unhook()
            self.scratch = None

    def release(self) -> None:
        """Let go of the kept outputs now, after the run, where the recorder itself stays (the session holds it for
        the report: its layers, op counts and notes)."""
        self.outputs.clear()
        self.shared.clear()
        self.stack.clear()
        self.mode.on_op = self.mode.on_write = self.mode.on_result = None
        self.before_write = None  # the model's kept state (its parameters' originals): the caller's to drop

    def _unhook(self) -> None:
        if self.own_hooks is not None:  # first: the hooks' own dicts back, before ours leave them
            self.own_hooks.__exit__()
            self.own_hooks = None
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _op(self, func) -> None:
        if self.rerunning:
            return
        if not self.grad_used and torch.is_grad_enabled():
            self.grad_used = True
        known = _OPS.get(func)
        if known is None:
            known = _OPS[func] = (random_op(func), optable.family(func.name()))
        drew, family = known
        if drew and self.stack:
            for frame in self.stack:
                frame.drew = True
        if family is not None:
            self.family_ops += 1
            self.by_family[family] += 1
            if family == "rnn":
                self.rnn_ops.add(func.name() + (PROJECTED if self.mode.rnn_projected else ""))
            if self.stack:
                self.stack[-1].ran = True
                self.stack[-1].families.add(family)

    def _written(self, tensors: list[torch.Tensor]) -> None:
        """Copy-on-write: a kept output is copied only when the model is about to write into its storage."""
        if self.before_write is not None:
            self.before_write(tensors)
        if self.own_hooks is not None:  # a hook of the model's writing into what it was given is no observer
            self.own_hooks.written(tensors)
        for t in tensors:
            keys = self.shared.pop(storage_address(t), None) if self.shared else None
            for key in keys or ():
                reference, norms = self.outputs[key]
                self.outputs[key] = (map_tensors(torch.clone, reference), norms)

    def _keep(self, name: str, i: int, output: Any) -> Any:
        """The output as kept: a large float64 tensor written out (``measure.spill``), the rest without a copy; a
        float32 one as a float64 copy. The reference computes every result in float64: a float32 output is the
        model's own state or a view of it (``return self.cache.t()``), which the layer's reruns write into and the
        rows' state put back (its introduced error read 0.0, its accumulated one NaN)."""
        kept = map_tensors(lambda t: self.spill.put(widen(t.detach())), output)
        for _, t in named_tensors(kept):
            self.shared.setdefault(storage_address(t), []).append((name, i))
        return kept

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            if not self.rerunning and transformed():  # its ops count toward the module that calls it
                self.called.add(name)
                if not any(name == t or name.startswith(t + ".") for t in self.transformed):  # the outermost
                    self.transformed.append(name)
            elif not self.rerunning:
                self.called.add(name)
                if self.own_hooks is not None:  # hooks the forward registered since: watched too
                    self.own_hooks.registered(module)
                # where it is rerun: the random streams as the call found them, for its reruns to draw alike
                state = self.streams.state() if self.streams is not None and (self.levels or name in self.pins) \
                    else None
                self.stack.append(_Frame(name, args, kwargs, state))

        return hook

    def _post(self, name: str, module: torch.nn.Module):
        def hook(module, args, kwargs, output):
            if self.rerunning or transformed():
                return None
            frame = self.stack.pop()
            if not frame.drew and frame.state is not None and self.streams is not None and \
                    self.streams.drew_since(frame.state):
                frame.drew = True  # from NumPy's or Python's generator: its reruns draw what it drew too
            if not frame.ran:
                if self.stack:
                    self.stack[-1].inner += frame.inner
                return None
            i = self.count.get(name, 0)
            if i == 0:
                self.layers.append((name, module))
            self.families.setdefault(name, set()).update(frame.families)
            self.count[name] = i + 1
            self.mode.paused = True  # our own arithmetic, in float64 already
            try:
                output = map_tensors(local, output)  # a DTensor's shard: what this rank holds
                norms: dict[str, Optional[float]] = {}
                now = bool(self.levels) or name in self.pins  # else the first row's comparison sums them
                for key, t in named_tensors(output):
                    if t.is_floating_point() or t.is_complex():
                        with bare(t):
                            # detached: a layer's output inside a forward that differentiates requires grad
                            norms[key] = reference_norm2(t.detach()) if now else None
                reference = self._keep(name, i, output)
                self.outputs[(name, i)] = (reference, norms)
                self._introduce(name, module, frame, i)
            finally:
                self.mode.paused = False
            if self.stack:
                self.stack[-1].inner.append((name, i))
            return None

        return hook

    def _introduce(self, name: str, module: torch.nn.Module, frame: _Frame, i: int) -> None:
        """Run ``module`` again under each level, fed the inputs of this call, its inner layers answering with
        their reference outputs; its output's error against the reference is what it introduces."""
        if versions((frame.args, frame.kwargs)) != frame.versions or (frame.held and frame.held.written()):
            # no control flow of the model's: said so (the conclusion names a layer whose calls diverged)
            self._worst(name, math.nan, f"{UNMEASURED} not fed: it changes its own inputs in place")
            return
        reference, norms = self.outputs[(name, i)]
        if not any(isinstance(leaf, (torch.Tensor, Spilled)) for _, leaf in named_leaves(reference)):
            # a torch.distributions object, or None (a layer that writes a buffer): no tensor a comparison reads
            # (it read 0.0)
            held = "None" if reference is None else f"a {type(reference).__name__}"
            self._worst(name, math.nan, f"{NO_TENSOR} ({held})")
            return
        tensors = [id(t) for _, t in named_tensors((frame.args, frame.kwargs))]
        if not frame.inner and tensors and all(t in self.model_inputs for t in tensors):
            # fed the model's own inputs and nothing nested: the end-to-end run computes exactly this call
            self.as_accumulated.add((name, i))
            return
        if not self.levels and name not in self.pins:  # no level reruns its layers in this pass
            return
        inner = self._inner_outputs(frame)
        pin = self.pins.get(name)
        cudnn = bool(frame.families & {"conv", "rnn"})
        streams = self.streams if frame.drew and frame.state is not None else None
        after = streams.state() if streams is not None else None  # the reference run goes on from here
        left = Held(frame.held.objects) if frame.held is not None else None  # the objects as the call left them
        try:
            self._reruns(name, module, frame, reference, norms, inner, pin, cudnn, streams)
        finally:
            if streams is not None:
                streams.put(after)
            if left is not None:
                left.put_back()
            if self.own_hooks is not None:  # what the model's hooks kept from the reruns: the reference's again
                self._hooks_again(self.own_hooks)

    def _hooks_again(self, hooks: OwnHooks) -> None:
        """The model's observer hooks that ran in the reruns, called again as the reference called them
        (``OwnHooks.put_back``), in the float64 run as at that call. Paused (our own arithmetic's), a hook's product
        of the float64 output and a float32 weight raised ("expected m1 and m2 to have the same dtype") and its
        ``output.float()`` kept a float32 value. Not the model's work a second time: no op counted, no layer call
        recorded, no choice kept."""
        mode = self.mode
        paused, choices, rerunning = mode.paused, mode.choices, self.rerunning
        mode.paused, mode.choices, self.rerunning = False, None, True
        try:
            hooks.put_back()
        finally:
            mode.paused, mode.choices, self.rerunning = paused, choices, rerunning

    def _reruns(self, name: str, module: torch.nn.Module, frame: _Frame, reference: Any, norms: dict[str, float],
                inner: dict[torch.nn.Module, list[Any]], pin: Optional[tuple[str, str]], cudnn: bool,
                streams: Optional[Streams]) -> None:
        # the reference run's own modes off the stack meanwhile: paused, they would pass each op through as it is,
        # at the cost of Python calls per op (the float32 inputs made once, again only where a rerun wrote into them:
        # the nested layers' answers too, which a layer may write into, as nn.ReLU(inplace=True) does)
        with contextlib.ExitStack() as quiet:
            for mode in (*self.mode.modes, *self.quiet):
                quiet.enter_context(modestack.lifted(mode))
            fed: Optional[tuple[Any, Any, list[Optional[int]]]] = None
            kept: Optional[KeptState] = None  # the layer's state, taken once and put back after each rerun
            # the levels rerun so far: error, why, and the ops the rerun computed (None: not all seen)
            done: list[tuple[str, float, Optional[str], Optional[tuple]]] = []
            for level, conv in [(level, None) for level in self.levels] + ([pin] if pin and cudnn else []):
                # a call whose own ops all get the same math at a level rerun before gives the same bits again
                # (emulation.reuse): that level's error, not a second run
                same = next((d for d in done if conv is None and d[3] is not None and
                             computed_alike(self.target, d[0], level, context_cells(), d[3], frame.families)),
                            None)
                if same is not None:
                    self._worst(name, same[1], same[2], level)
                    continue
                if fed is None or versions((*fed[:2], list(inner.values()))) != fed[2]:
                    if fed is not None:
                        inner = self._inner_outputs(frame)
                    made = map_tensors(_to_float32, frame.args), map_tensors(_to_float32, frame.kwargs)
                    fed = (*made, versions((*made, list(inner.values()))))
                # sharded: every rank reruns, for the collectives in the rerun and in its error's reduction
                watch = Handoff(frozenset()) if conv is None and self.ranks is None and self.target.emulated \
                    else None
                kept = kept or KeptState(module, parameters=False)
                error, why = self._rerun(name, module, frame, reference, norms, inner, pin, cudnn, streams, level,
                                         conv, fed[0], fed[1], kept, watch)
                if conv is None:
                    done.append((level, error, why, tuple(watch.ops) if watch is not None and
                                 watch.state == "watch" and watch.ops else None))

    def all_fed(self) -> bool:
        """Whether every layer call was fed the model's own inputs with nothing nested in it: a pass rerunning some
        level would rerun none of them, each call's introduced error being its accumulated one in a row."""
        return sum(self.count.values()) == len(self.as_accumulated)

    def weight_cache(self) -> bool | str:
        """``emulate()``'s ``weight_cache`` for a row or a rerun, each one run of the model: a rounded copy kept
        from a parameter's second use on (a copy of every weight, held to the run's end, raised MiniLM's check peak by
        26 MiB); sharded, none (the gathered parameters would stay whole on every rank)."""
        return REUSED if self.ranks is None else False

    def grad_mode(self) -> Any:
        """The grad mode a float32 run of the model runs in: inference mode (cheaper), or no_grad where the model
        turned autograd on in the reference run (:attr:`grad_used`)."""
        return torch.no_grad() if self.grad_used else torch.inference_mode()

    def _alike(self, first: str, second: str) -> frozenset[str]:
        known = self.alike.get((first, second))
        if known is None:
            known = self.alike[(first, second)] = alike(self.target, first, second, context_cells()) \
                if self.target.emulated else frozenset()
        return known

    def _rerun(self, name: str, module: torch.nn.Module, frame: _Frame, reference: Any, norms: dict[str, float],
               inner: dict[torch.nn.Module, list[Any]], pin: Optional[tuple[str, str]], cudnn: bool,
               streams: Optional[Streams], level: str, conv: Optional[str], args: Any, kwargs: Any,
               kept: KeptState, watch: Optional[Handoff] = None) -> tuple[float, Optional[str]]:
        """One rerun of a layer's call at ``level`` (and cuDNN conv math ``conv``), fed ``args`` and ``kwargs``: its
        error and why it has none; ``kept``: the layer's state before its reruns, put back after this one;
        ``watch``: notes the families the rerun computes (``Handoff.watch``)."""
        if streams is not None:  # a call that drew: each rerun draws what the reference's call drew
            streams.put(frame.state)
        if frame.held is not None:  # and is given the objects (a cache) as the call was given them, in float32
            frame.held.put_back(self.narrowed)
        self.rerunning = True
        try:
            with kept, _originals(self.swapped), _answering(inner), _uncaptured(), \
                    level_context(level, self.target, self.accumulation, self.weight_cache(), watch), \
                    conv_math(conv), self.grad_mode():
                if watch is not None:
                    watch.watch()
                output = module(*args, **kwargs)
            error = self._normwise(output, reference, norms, f"layer {name!r} run alone")
            why = None
        except (Tf32LabError, KeyboardInterrupt):
            raise
        except BaseException as exc:  # sys.exit() included: as a level's run, a finding about this layer
            if out_of_memory(exc) or self.ranks is not None:  # sharded: the other ranks wait in a collective
                raise
            at = f"level {level!r}" + (f" and cuDNN's conv math {conv!r}" if conv else "")
            bug = internal_error(exc, f"rerunning layer {name!r} alone at {at}")
            if bug is not None:
                raise bug from exc
            error, why = math.nan, f"raised when run alone at {'its pinned conv math' if conv else 'this level'}" \
                                   f": {described(exc)}"
            if _float64_met(exc):  # fed float32, in a float32 model: a value the reference run left (a cache)
                why = f"{UNMEASURED} run alone, it met a float64 value the float64 reference left where it reads " \
                      f"it (a draw or result the model caches within a call, as pyro's PyroSample does): " \
                      f"{described(exc)}"
        finally:
            self.rerunning = False
        self._worst(name, error, why, level, conv)
        if pin and not cudnn and conv is None and level == pin[0]:  # no cuDNN op: the same at any conv math
            self._worst(name, error, why, level, pin[1])
        return error, why

    def _worst(self, name: str, error: float, why: Optional[str], level: Optional[str] = None,
               conv: Optional[str] = None) -> None:
        """Keep ``error`` as ``name``'s at ``level`` (None: at every level, and at its pin) or, with ``conv``, at its
        pin."""
        if level is None:
            tables = [self.introduced[lv] for lv in self.levels] + ([self.pinned] if name in self.pins else [])
        else:
            tables = [self.introduced[level] if conv is None else self.pinned]
        for table in tables:
            known = table.get(name)
            # the worst call wins; a call that could not be measured (NaN) wins over any number, and stays
            if known is None or (not math.isnan(known[0]) and (math.isnan(error) or error > known[0])):
                table[name] = (error, why or (known[1] if known else None))

    def _inner_outputs(self, frame: _Frame) -> dict[torch.nn.Module, list[Any]]:
        modules = dict(self.layers)
        answers: dict[torch.nn.Module, list[Any]] = {}
        for name, i in frame.inner:
            answers.setdefault(modules[name], []).append(
                map_tensors(_to_float32, self.outputs[(name, i)][0], _ANSWERED))
        return answers

    def _normwise(self, output: Any, reference: Any, norms: dict[str, float], site: str) -> float:
        if self.scratch is None:
            self.scratch = scratch(_device_of(reference))
        error, _ = tree_normwise(map_tensors(local, output), reference, norms, self.scratch, self.ranks, site)
        return error

    def notes(self) -> list[str]:
        """What the report must say about the reference run."""
        found = []
        if self.scripted:
            names = ", ".join(repr(s) for s in self.scripted[:5]) + (" …" if len(self.scripted) > 5 else "")
            found.append(f"not broken down into layers: {names} (TorchScript: PyTorch takes no hooks on a "
                         f"ScriptModule); its ops count toward the module that calls it, and the outputs are "
                         f"measured end to end; its reference ran on a float64 copy of it")
        if self.transformed:
            names = ", ".join(repr(s) for s in self.transformed[:5]) + (" …" if len(self.transformed) > 5 else "")
            found.append(f"not broken down into layers where called inside a torch.func transform (vmap, grad, "
                         f"whose batched tensors a layer's rerun cannot be fed): {names}; the ops of those calls "
                         f"count toward the module that makes them")
        if self.mode.float32_writes:
            # a buffer it updates, or an input it scales in place (x.mul_(2)): "buffers" alone misled for an input
            found.append(f"the reference wrote {self.mode.float32_writes} time(s) into float32 tensors the model "
                         f"holds or is given (a buffer it updates, an input it writes into): those values are "
                         f"rounded to float32 in the reference too")
        return found


def _around_sharding(model: torch.nn.Module, mode: Float64Run) -> list:
    """Hooks that run FSDP2's own hooks (the parameters' all-gather into float32 buffers it allocates, their
    release) outside the float64 mode: data movement, exact in float32, which widening would break (a buffer it
    asks for in float32 would come in float64). Each module's hooks sit between a pause and a put-back."""
    fsdp = _fsdp_module_type()
    if fsdp is None:
        return []
    kept: list[bool] = []

    def pause(*_: Any) -> None:
        kept.append(mode.paused)
        mode.paused = True

    def put_back(*_: Any) -> None:
        if kept:
            mode.paused = kept.pop()

    handles = []
    for module in model.modules():
        if isinstance(module, fsdp):
            handles += [module.register_forward_pre_hook(pause, prepend=True),
                        module.register_forward_pre_hook(put_back),
                        module.register_forward_hook(pause, prepend=True),
                        module.register_forward_hook(put_back)]
    return handles


def _fsdp_module_type() -> Any:
    # FSDP2's class (torch >= 2.6) where a model can hold one: an FSDP2 module exists only once its package is
    # imported, and importing it here cost every check 0.9 s of CPU (half of `import torch`) for nothing
    return getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)


@contextlib.contextmanager
def _uncaptured():
    """transformers 5's output-capturing hooks idle while a layer reruns. Its forward gathers the attentions (hidden
    states, ...) it returns by forward hooks on their modules, each appending its call's output to the collection
    the forward holds (``transformers.utils.output_capturing._active_collector``): a rerun of an attention, a layer,
    appended its own, and the float64 reference returned one attention more than the rows, another call's in place
    of the last. Not looked up where transformers was never imported."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    # under torch.compile it is a global its set and reset do not nest in (none of a rerun's business)
    if collector is None or getattr(collector, "compiling", False) or collector.get() is None:
        yield
        return
    token = collector.set(None)
    try:
        yield
    finally:
        collector.reset(token)


@contextlib.contextmanager
def _answering(answers: dict[torch.nn.Module, list[Any]]):
    """The modules in ``answers`` return their next recorded output instead of computing (a layer's own error
    leaves out the layers nested in it). The output was kept as the module's forward hooks left it (a hook that
    doubles it, its double): an answer is not given to them again, which still run (their other work, FSDP's
    reshard), their result let go."""
    saved: dict = {}
    hooked: list[tuple[dict, int, Callable, Callable]] = []  # (the module's hook dict, key, hook, its wrapper)
    for module, outputs in answers.items():
        pending = iter(outputs)
        original = module.forward
        answered = [False]  # whether the module's call now running was answered

        def forward(*args, _pending=pending, _original=original, _answered=answered, **kwargs):
            _answered[0] = False
            return _next_or_run(_pending, _original, args, kwargs, _answered)

        saved[module] = module.__dict__.get("forward", _MISSING)
        module.forward = forward
        # wrapped in the module's own dict, which their handles hold (a hook that removes itself stays removed)
        hooks = module._forward_hooks
        for key, hook in list(hooks.items()):
            hooks[key] = _after_answer(hook, answered)
            hooked.append((hooks, key, hook, hooks[key]))
    try:
        yield
    finally:
        for module, before in saved.items():
            if before is _MISSING:
                del module.forward
            else:
                module.forward = before
        unwrapped(hooked)


def _after_answer(hook: Callable, answered: list[bool]) -> Callable:
    """``hook``, whose result is let go where the call it follows was answered."""
    def run(*args: Any, **kwargs: Any) -> Any:
        out = hook(*args, **kwargs)
        return None if answered[0] else out

    return run


def _float64_met(exc: BaseException) -> bool:
    """PyTorch's refusal of a float64 operand beside a float32 one ("expected m1 and m2 to have the same dtype, but
    got: float != double", "expected scalar type Double but found Float", "Input type (double) and bias type
    (float) should be the same")."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and "double" in text and "float" in text and "type" in text


def _next_or_run(pending, original, args, kwargs, answered: list[bool]) -> Any:
    if transformed():  # a call inside vmap was no layer call of the reference: it computes, as its caller's ops
        return original(*args, **kwargs)
    answer = next(pending, _MISSING)
    if answer is _MISSING:
        return original(*args, **kwargs)
    answered[0] = True
    return answer


def _device_of(tree: Any) -> torch.device:
    return next((t.device for _, t in named_tensors(tree)), torch.device("cpu"))


def _to_float32(t: Any) -> Any:
    if isinstance(t, _OBJECTS):
        # a layer's answer as a torch.distributions object (zuko's flows return transforms): its tensors are its
        # attributes, narrowed on a copy; the reference's own, float64, made its caller's rerun raise
        made = copy.copy(t)
        for key, value in vars(t).items():
            made.__dict__[key] = map_tensors(_to_float32, value, _ANSWERED)
        return made
    if isinstance(t, Spilled):
        return t.load(torch.float32)
    if t.dtype == torch.float64:
        return t.float()
    return t.to(torch.complex64) if t.dtype == torch.complex128 else t.clone()


class Accumulated:
    """Hooks on the layers for one end-to-end run: each call's output against the reference output of the same
    call, the worst kept per layer; a call that cannot be matched makes the layer diverged."""

    def __init__(self, recorder: Recorder, counting: Optional[Counting] = None) -> None:
        self.recorder, self.counting = recorder, counting
        self.errors: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.diverged: dict[str, str] = {}
        self.per_call: dict[tuple[str, int], float] = {}  # for the calls in recorder.as_accumulated
        self.handles: list = []
        self.scratch: Optional[torch.Tensor] = None

    def __enter__(self) -> Accumulated:
        for name, module in self.recorder.layers:
            self.handles.append(module.register_forward_hook(self._post(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.scratch = None

    def _post(self, name: str):
        def hook(module, args, output):
            if transformed():  # not a layer call in the reference either (Recorder._pre)
                return None
            if self.counting is None:
                return self._measure(name, output)
            self.counting.paused = True  # our arithmetic is not the model's work
            try:
                return self._measure(name, output)
            finally:
                self.counting.paused = False

        return hook

    def _measure(self, name: str, output: Any) -> None:
        i = self.count.get(name, 0)
        self.count[name] = i + 1
        found = self.recorder.outputs.get((name, i))
        if found is None:
            return
        reference, norms = found
        if self.scratch is None:
            self.scratch = scratch(_device_of(reference))
        error, mismatch = tree_normwise(map_tensors(local, output), reference, norms, self.scratch,
                                        self.recorder.ranks, f"call {i + 1} of layer {name!r}")
        if (name, i) in self.recorder.as_accumulated:
            self.per_call[(name, i)] = error
        if mismatch is not None:
            self.diverged.setdefault(name, f"call {i + 1}: {mismatch}")
        elif name not in self.errors or math.isnan(error) or error > self.errors[name]:  # 0 is measured too
            self.errors[name] = error

    def result(self, name: str, finished: bool) -> tuple[float, Optional[str]]:
        """The worst accumulated error of ``name`` over its matched calls, and why it diverged, if it did."""
        expected, seen = self.recorder.count[name], self.count.get(name, 0)
        why = self.diverged.get(name)
        if why is None and seen != expected and (finished or seen > expected):
            why = f"called {seen} time(s) end to end, {expected} in the reference"
        return self.errors.get(name, math.nan), why
