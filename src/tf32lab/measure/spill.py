"""Kept float64 reference outputs too large to hold in memory: written to a temporary file, read back in chunks.

``check`` keeps each layer's float64 output from the reference run to measure the end-to-end runs against it. On a
model whose activations dwarf its weights (a convolutional front end over a long signal) one such output can
weigh more than the whole native forward. A :class:`SpillFile` takes the large ones out of memory: written once,
when the reference produced them, and read back a chunk at a time into a buffer the caller reuses, so neither the
file's pages nor a second copy ever count against the process. The file is unlinked from the start: nothing stays
on disk after the process, even if it is killed.

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
from typing import IO, Optional, Union

import torch

from tf32lab import settings
from tf32lab.errors import Tf32LabError

__all__ = ["DEFAULT_MIB", "SpillFile", "Spilled", "min_bytes_from_env"]

DEFAULT_MIB: float = settings.SETTINGS["TF32LAB_SPILL_MIB"].default


def min_bytes_from_env() -> Optional[int]:
    """The size from which a kept tensor is written out (``TF32LAB_SPILL_MIB``, ``tf32lab.settings``); None: never.
    A bad value is a one-line ``Tf32LabError``."""
    mib = settings.get("TF32LAB_SPILL_MIB")
    return None if mib == 0 else max(1, int(mib * 2**20))


class Spilled:
    """A float64 tensor written to a :class:`SpillFile`: its shape, and where its elements lie."""

    __slots__ = ("file", "numel", "offset", "shape")

    def __init__(self, file: SpillFile, offset: int, shape: torch.Size) -> None:
        self.file, self.offset, self.shape = file, offset, shape
        self.numel = shape.numel()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def chunks(self, buffer: torch.Tensor) -> Iterator[torch.Tensor]:
        """The elements in order, flat, a ``buffer``'s length at a time (each chunk a view of ``buffer``: it is
        overwritten by the next one)."""
        for start in range(0, self.numel, buffer.numel()):
            part = buffer[:min(buffer.numel(), self.numel - start)]
            self.file.read_into(part, self.offset + start * 8)
            yield part

    def load(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The whole tensor back, as ``dtype`` (read in chunks: no float64 copy when ``dtype`` is narrower)."""
        out = torch.empty(self.numel, dtype=dtype)
        if dtype == torch.float64:
            self.file.read_into(out, self.offset)
        else:
            buffer = torch.empty(min(self.numel, 1 << 20), dtype=torch.float64)
            for i, part in enumerate(self.chunks(buffer)):
                out[i * buffer.numel():i * buffer.numel() + part.numel()].copy_(part)
        return out.view(self.shape)


class SpillFile:
    """An unlinked temporary file that large float64 CPU tensors are written to (see the module's docstring)."""

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

    def wants(self, t: torch.Tensor) -> bool:
        return (self.min_bytes is not None and not self._broken and t.dtype == torch.float64
                and t.device.type == "cpu" and t.numel() * 8 >= self.min_bytes)

    def put(self, t: torch.Tensor) -> Union[Spilled, torch.Tensor]:
        """``t`` written out, as a :class:`Spilled`; ``t`` itself when it is not worth it or cannot be written."""
        if not self.wants(t):
            return t
        try:
            if self._file is None:
                self._file = tempfile.TemporaryFile(dir=self.directory)  # noqa: SIM115 (closed by close())
            offset = self._file.seek(0, os.SEEK_END)
            data = t.detach().contiguous().view(-1)
            self._file.write(memoryview(data.numpy()).cast("B"))
            self._file.flush()
        except OSError:  # a full or unwritable disk: memory it is, from now on
            self._broken = True
            return t
        self.written += data.numel() * 8
        return Spilled(self, offset, t.shape)

    def read_into(self, out: torch.Tensor, offset: int) -> None:
        if self._file is None:
            raise Tf32LabError("the spill file is closed: what it held ended with the check that wrote it")
        view = memoryview(out.numpy()).cast("B")
        fd = self._file.fileno()
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise Tf32LabError(f"the spill file ended {len(view) - done} bytes early at offset {offset}")
            done += n
