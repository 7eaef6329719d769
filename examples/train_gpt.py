"""Train a small GPT on a tokload dataset with DDP, and resume it on another world size.

Plain PyTorch and tokload, nothing else. Each step reads a fixed global batch of
``--global-batch`` windows of ``--seq-len + 1`` tokens; every rank reads
``global_batch // world_size`` of them (so the world size must divide the global
batch). A checkpoint, written with ``torch.distributed.checkpoint`` (DCP), holds the
model, the optimizer, the step and the DataLoader's state (its cursor: the first
global position not yet delivered) together. Since the global batch does not depend
on the number of processes, a run resumed on another world size reads exactly the
samples the interrupted run would have read next, and takes the same optimizer steps.

Build a dataset (here: byte tokens of a JSONL file with a "text" field), train on 2
processes to step 40 with a checkpoint every 20 steps, then resume on 3 processes and
train on to step 60:

    tokload build docs.jsonl -o corpus --tokenizer bytes
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py \\
        --data corpus --ckpt ckpt --steps 40 --save-every 20 --log-file log.jsonl
    torchrun --standalone --nproc_per_node=3 examples/train_gpt.py \\
        --data corpus --ckpt ckpt --steps 60 --save-every 20 --log-file log.jsonl

The second command finds the latest checkpoint in ``ckpt/`` (``ckpt/step-00000040``)
and goes on from it. On GPUs the processes use NCCL and ``cuda:LOCAL_RANK``; on CPU,
gloo. With a ``tokenizer.json`` dataset, pass its ``--vocab-size``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import tokload


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        # [b, t, c] -> [b, heads, t, c // heads]
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """Token embedding + learned positions, ``layers`` blocks, a head tied to the embedding."""

    def __init__(self, vocab: int, seq_len: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


class TrainState:
    """Model, optimizer and step as one ``Stateful`` for DCP.

    ``get_state_dict``/``set_state_dict`` give the model and optimizer states with
    the DDP wrapper's ``module.`` prefix removed, so any world size can load them.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer, self.step = model, optimizer, 0

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.step = int(state["step"])


def latest_checkpoint(ckpt: Path) -> Path | None:
    """The checkpoint of the highest step in ``ckpt``; DCP writes ``.metadata`` last,
    so a directory without it is an unfinished save and is ignored."""
    done = sorted(p for p in ckpt.glob("step-*") if (p / ".metadata").exists())
    return done[-1] if done else None


def lr_at(step: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then constant. A schedule that is a function of the step alone
    needs no state of its own in the checkpoint."""
    return lr * min(1.0, (step + 1) / warmup)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small GPT on a tokload dataset with DDP.")
    p.add_argument("--data", required=True, help="a tokload dataset (e.g. from tokload build)")
    p.add_argument("--steps", type=int, default=100, help="train up to this step")
    p.add_argument("--global-batch", type=int, default=12, help="windows per step, all ranks")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training window")
    p.add_argument("--ckpt", type=Path, help="checkpoint directory (resumes from its latest)")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps")
    p.add_argument("--log-file", type=Path, help="append one JSON line per step (rank 0)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps")
    p.add_argument("--seed", type=int, default=1234, help="model init and data order")
    p.add_argument("--vocab-size", type=int, default=258, help="258: the byte tokenizer")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE...
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {world} ranks")

    # The same initial weights on every rank (DDP also broadcasts rank 0's).
    torch.manual_seed(args.seed)
    model = GPT(args.vocab_size, args.seq_len, args.dim, args.layers, args.heads).to(device)
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    # Windows of seq_len + 1 tokens (inputs + the next token), overlapping by one.
    view = tokload.TokenStream(args.data, window=args.seq_len + 1, stride=args.seq_len)
    # Rank r reads its share of each global batch; no communication between ranks.
    loader = tokload.DataLoader(
        view, batch_size=args.global_batch // world, seed=args.seed, device=device if cuda else None
    )

    # The checkpoint: model + optimizer + step, and the loader (a Stateful: its
    # state_dict() is the cursor and what it was computed for; the same on every rank).
    train = TrainState(model, opt)
    state: dict[str, Any] = {"train": train, "loader": loader}
    latest = latest_checkpoint(args.ckpt) if args.ckpt else None
    if latest is not None:
        dcp.load(state, checkpoint_id=latest)
        if rank == 0:
            print(f"resumed from {latest}: step {train.step}, cursor {loader.cursor}", flush=True)

    # zip takes from range first: the loader is not advanced past the last step.
    for step, batch in zip(range(train.step, args.steps), loader, strict=False):
        tokens = batch["tokens"].long()
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup)
        logits = ddp(inputs)
        # A mean over this rank's tokens; DDP averages the gradients over ranks of
        # equal batches, which is the gradient of the mean over the global batch.
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train.step = step + 1

        # The global batch's mean loss (gloo has no AVG: sum, then divide).
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0 and args.log_file:
            rec = {"step": train.step, "loss": total.item() / world}
            rec |= {"world_size": world, "cursor": loader.cursor}
            with open(args.log_file, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if args.ckpt and (train.step % args.save_every == 0 or train.step == args.steps):
            dcp.save(state, checkpoint_id=args.ckpt / f"step-{train.step:08d}")

    loader.close()
    # DDP before the process group: DDP's reducer holds the group, and would free it
    # last while holding the GIL, as Gloo's worker threads may still need the GIL to free
    # a finished collective's tensors (a deadlock at exit, torch issue 56297). Freed by
    # destroy_process_group instead, the group lets the GIL go while its threads stop.
    del ddp
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
