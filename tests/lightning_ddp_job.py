"""Two CPU ranks under Lightning's own launcher (DDP started by multiprocessing, as ``ddp_spawn``): a fit without the
check, then one with it; each rank says its verdict, and the main process whether the weights are the same
(tests/test_integrations_lightning.py).

The ranks start from a forkserver that has imported Lightning and tf32lab once (``start_method="forkserver"``, the
launcher ``ddp_spawn`` uses, with another start method): the trainer, module and callback still reach each rank
pickled, as under ``ddp_spawn``, but the four ranks of the two fits no longer import Lightning each (6.8 s of CPU
apiece on a 2-core AMD EPYC: it imports torchmetrics, transformers and torch._dynamo); the job went from 36 to 16 CPU
seconds. Python 3.11's forkserver does not preload ``__main__`` by itself (only its ``sys_path`` reaches it), hence
the explicit preload.

Each rank traces what it trained (``Traced``): every step's batch and loss and its final weights, so that the test
holds every rank to the same weights in both fits, not rank 0's alone, and says where they part."""

import hashlib
import itertools
import multiprocessing
import sys
import warnings

import pytorch_lightning as L
import torch
from pytorch_lightning.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from tf32lab.integrations.lightning import Tf32Check


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def setup(self, stage):
        # Under forkserver the module reaches each rank in memory shared by the ranks: Lightning unshares a CPU
        # module's tensors only under spawn (_disable_module_memory_sharing), and two ranks' optimizers then step
        # the same weights in a race, whose result differs from run to run. Each rank takes its own, as under spawn.
        with torch.no_grad():
            for tensor in itertools.chain(self.parameters(), self.buffers()):
                tensor.data = tensor.data.clone()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self(x) - y).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class Said(L.Callback):
    def __init__(self, check):
        self.check = check

    def on_train_end(self, trainer, module):
        sys.stdout.write(f"rank {trainer.global_rank}: passed={self.check.passed} "
                         f"report={self.check.report is not None}\n")  # one write (see below)
        sys.stdout.flush()


class Traced(L.Callback):
    """What each rank trained, for the test's message where the weights differ: each step's batch and loss, the
    thread count, and the final weights' digest (one line a rank and fit)."""

    def __init__(self, name):
        self.name, self.steps = name, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps.append(f"{_digest(batch[0])}:{float(outputs['loss']).hex()}")

    def on_train_end(self, trainer, module):
        sys.stdout.write(f"trace of rank {trainer.global_rank}, {self.name}: threads {torch.get_num_threads()}, "
                         f"weights {_digest(*module.parameters())}, steps {' '.join(self.steps)}\n")
        sys.stdout.flush()


def _digest(*tensors):
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in tensors)).hexdigest()[:12]


def fit(folder, check):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    module = Regression()
    trainer = L.Trainer(strategy=DDPStrategy(start_method="forkserver"), accelerator="cpu", devices=2, max_epochs=1,
                        callbacks=[check, Said(check), Traced("with")] if check else [Traced("without")],
                        default_root_dir=folder, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(data, batch_size=8, shuffle=True))
    return module


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    multiprocessing.set_forkserver_preload(["pytorch_lightning", "tf32lab.integrations.lightning"])
    plain = fit(sys.argv[1] + "/a", None)
    checked = fit(sys.argv[1] + "/b", Tf32Check(steps=2, levels=("highest", "high"), on_fail=sys.argv[2]))
    # one write: the processes share one pipe, and print() writes its parts apart (another's output could land
    # inside the line)
    same = all(torch.equal(p, q) for p, q in zip(plain.parameters(), checked.parameters()))
    sys.stdout.write(f"same weights: {same}\n")
    sys.stdout.flush()
