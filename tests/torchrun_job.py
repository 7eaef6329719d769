"""One segment of a distributed job, launched by tests/test_torchrun.py under torchrun.

Each rank builds a DataLoader with no rank arguments (it reads them from
torch.distributed), resumes from --state-in if given, takes --steps steps (-1:
to the end), and records every (position, index) it received. The states of
all ranks are compared (the only communication here is the test's own) and
rank 0 writes the common one to --state-out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch.distributed as dist

import tokload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--epochs", type=int, required=True)
    ap.add_argument("--state-in")
    ap.add_argument("--state-out", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    view = tokload.TokenStream(args.data, window=17, stride=13)
    # host batches on every machine (the ranks of one GPU host share its device)
    loader = tokload.DataLoader(
        view, args.batch, seed=1234, epochs=args.epochs, num_threads=2, device=None
    )
    assert (loader.rank, loader.world_size) == (rank, dist.get_world_size())
    if args.state_in:
        loader.load_state_dict(json.loads(Path(args.state_in).read_text()))
    got = []
    for step, batch in enumerate(loader):
        got.append(np.stack([batch["position"].numpy(), batch["index"].numpy()], axis=1))
        if step + 1 == args.steps:
            break
    state = loader.state_dict()
    loader.close()
    states: list[dict[str, object] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    assert all(s == state for s in states), states
    out = np.concatenate(got) if got else np.zeros((0, 2), np.int64)
    np.save(Path(args.out) / f"rank{rank}.npy", out)
    if rank == 0:
        Path(args.state_out).write_text(json.dumps(state))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
