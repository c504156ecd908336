"""A model too large for one process, checked sharded: run on every rank of a ``torchrun`` job.

    torchrun --nproc-per-node 4 -m tf32lab check examples/sharded/model.py:transformer --levels highest,high

tf32lab initialises the process group (gloo on CPU, NCCL on GPUs) before it calls the factory; the factory
shards the model with FSDP2 (``fully_shard``) and gives each rank its part of the batch. ``tensor_parallel`` is
the same for a tensor-parallel MLP (DTensor, ``parallelize_module``): every rank gets the whole batch.
Called in one process (no job), each factory returns the whole model and the whole batch: the check to compare with.
"""

from __future__ import annotations

import torch
from torch import nn

import tf32lab


class Block(nn.Module):
    """A pre-norm transformer block: attention, then an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 512, width: int = 64, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _ranks() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (world,))


def transformer(batch: int = 8, tokens: int = 16, width: int = 64, depth: int = 2, vocab: int = 512,
                seed: int = 0) -> tf32lab.Workload:
    """The transformer, FSDP2-sharded over the job's ranks (each block, then the whole), and this rank's rows of
    one seeded batch (``batch`` must divide by the number of ranks)."""
    torch.manual_seed(seed)
    model = Transformer(vocab, width, max(1, width // 16), depth)
    ids = torch.randint(0, vocab, (batch, tokens))
    rank, world = _ranks()
    if world > 1:
        from torch.distributed.fsdp import fully_shard
        mesh = _mesh(world)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ids = ids.chunk(world)[rank]
    return tf32lab.Workload(model, ids, name="sharded-transformer")


def mlp(width: int = 64, hidden: int = 256) -> nn.Module:
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


def tensor_parallel(batch: int = 16, width: int = 64, hidden: int = 256, seed: int = 0,
                    row_parallel: bool = True) -> tf32lab.Workload:
    """The MLP with its first layer column-parallel and its second row-parallel (Megatron's MLP; with
    ``row_parallel=False`` column-parallel too, its input gathered), the whole batch on every rank."""
    torch.manual_seed(seed)
    model = mlp(width, hidden)
    x = torch.randn(batch, width)
    _, world = _ranks()
    if world > 1:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        second = RowwiseParallel() if row_parallel else ColwiseParallel(input_layouts=Replicate(),
                                                                        output_layouts=Replicate())
        first = ColwiseParallel() if row_parallel else ColwiseParallel(output_layouts=Replicate())
        parallelize_module(model, _mesh(world), {"0": first, "2": second})
    return tf32lab.Workload(model, x, name="tensor-parallel-mlp")


def large(batch: int = 8, tokens: int = 32, width: int = 512, depth: int = 12, vocab: int = 1024,
          seed: int = 0) -> tf32lab.Workload:
    """The transformer as one builds a model that does not fit in one process: on the ``meta`` device (no
    memory), sharded with FSDP2, then each rank's shards allocated and initialised; no rank ever holds it whole.
    In one process it is built whole. Weights are seeded per rank (another model than ``transformer``'s)."""
    rank, world = _ranks()
    torch.manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, tokens))
    if world == 1:
        return tf32lab.Workload(Transformer(vocab, width, max(1, width // 64), depth), ids, name="large-transformer")
    from torch.distributed.fsdp import fully_shard
    with torch.device("meta"):
        model = Transformer(vocab, width, max(1, width // 64), depth)
    mesh = _mesh(world)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed + rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shard = p.to_local()
            if name.endswith("bias"):
                shard.zero_()
            elif "norm" in name:
                shard.fill_(1.0)
            else:
                shard.normal_(0.0, 0.02)
    return tf32lab.Workload(model, ids.chunk(world)[rank], name="large-transformer")
