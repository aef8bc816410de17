"""Train a tiny model with torch's DataLoader on shards in a cachefs mount, telling cachefs each epoch's reads.

    python examples/train_pytorch.py --data /mnt/cachefs/shards --epochs 3

Copy what you need: the dataset (`ShardWindows`, each sample a fixed-size
window of a shard file, read with os.pread) and the two lines that make the
sampler a `cachefs.plan.PlanSampler`. The script mounts nothing: point
`--data` at a directory of shard files in a cachefs mount (`cachefs mount
...`). Anywhere else it trains too, without a plan (PlanSampler warns once).

Mount with a block size near the sample size: for the default 256 KiB
samples, `cachefs mount --block-size 256K ...`: a cold epoch fetches whole
blocks, and with 1 MiB blocks its first batches need most of the dataset's
blocks at once (docs/training.md, "Block size against sample size").
PlanSampler logs the block size to use, once, when the mount's blocks are
much larger than the samples.

Per epoch it prints samples/s and busy % (the share of the wall time the
model spent computing rather than waiting for data). The model is tiny, so
on its own it waits most of the time; `--compute-ms` adds time per batch to
stand in for a model that keeps an accelerator busy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler

import cachefs.plan


class ShardWindows(Dataset):
    """Every whole `window`-byte window of every file in a directory: sample i is (file, offset)."""

    def __init__(self, directory: Path, window: int) -> None:
        self.paths = sorted(str(path) for path in directory.iterdir() if path.is_file())
        self.window = window
        self.samples = [(number, offset) for number, path in enumerate(self.paths)
                        for offset in range(0, os.path.getsize(path) - window + 1, window)]
        self._fds: dict[int, int] = {}  # opened lazily in each worker process

    def __len__(self) -> int:
        return len(self.samples)

    def reads_of(self, index: int) -> list[tuple[str, int, int]]:
        """What sample `index` reads: the plan PlanSampler hands to cachefs is made of these."""
        number, offset = self.samples[index]
        return [(self.paths[number], offset, self.window)]

    def __getitem__(self, index: int) -> torch.Tensor:
        number, offset = self.samples[index]
        fd = self._fds.get(number)
        if fd is None:
            fd = self._fds[number] = os.open(self.paths[number], os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # random windows: kernel read-ahead would only waste
        data = os.pread(fd, self.window, offset)
        if len(data) != self.window:
            raise OSError(f"short read of {self.paths[number]} at {offset}")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class TinyModel(nn.Module):
    """Bytes -> 64 features (means of equal slices) -> one number."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        features = batch.float().view(batch.shape[0], 64, -1).mean(dim=2) / 255
        return self.layers(features)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1:].upper() in units:
        return int(float(text[:-1]) * units[text[-1:].upper()])
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a directory of shard files, e.g. /mnt/cachefs/shards")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sample-size", default="256K",
                        help="bytes per sample, a multiple of 64 (default: %(default)s; mount with --block-size 256K for it)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=4, help="DataLoader worker processes (default: %(default)s)")
    parser.add_argument("--compute-ms", type=float, default=0.0, help="extra time per batch, as a bigger model would take")
    parser.add_argument("--max-batches", type=int, help="stop each epoch after this many batches")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    window = parse_size(args.sample_size)
    if not args.data.is_dir():
        parser.error(f"--data {args.data}: not a directory")
    if window <= 0 or window % 64:
        parser.error(f"--sample-size {args.sample_size}: must be a positive multiple of 64 bytes")
    dataset = ShardWindows(args.data, window)
    if not len(dataset):
        parser.error(f"--data {args.data}: no file holds a whole {window}-byte sample")

    # The two lines for cachefs: wrap the sampler, say what each sample reads.
    shuffle = RandomSampler(dataset, generator=torch.Generator().manual_seed(args.seed))
    sampler = cachefs.plan.PlanSampler(shuffle, reads_of=dataset.reads_of)

    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        persistent_workers=args.workers > 0)
    model = TinyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    print(f"{len(dataset)} samples of {window} bytes in {len(dataset.paths)} files, batch {args.batch_size}, "
          f"{args.workers} workers", flush=True)
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        samples, compute_s, loss = 0, 0.0, torch.tensor(0.0)
        started = time.monotonic()
        for number, batch in enumerate(loader):
            if args.max_batches is not None and number >= args.max_batches:
                break
            began = time.monotonic()
            loss = model(batch).square().mean()  # a made-up target: any loss trains the loop the same way
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if args.compute_ms:
                time.sleep(max(0.0, args.compute_ms / 1000 - (time.monotonic() - began)))
            compute_s += time.monotonic() - began
            samples += len(batch)
        wall_s = time.monotonic() - started
        print(f"epoch {epoch}: {samples} samples in {wall_s:.2f} s, {samples / wall_s:.1f} samples/s, "
              f"busy {100 * compute_s / wall_s:.1f} %, loss {loss.item():.4f}", flush=True)
    sampler.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
