"""The PyTorch side of `fsdp-bench recovery`: DeepNet on Fashion-MNIST, DDP on Gloo under
torchrun (--max_restarts N), a full checkpoint (model + optimizer + step) written with
torch.save by rank 0 every --checkpoint_every steps, and a restart resuming from the newest
one: the usual recipe of a torchrun job. Same recipe as build/bin/mnist (Adam 1e-3, global
batch split over ranks, dropout off).

Rank 0 appends JSON lines to --metrics_file, as fsdprun's Trainer does:
  {"type": "train", "step": S, "step_time_ms": ..., "unix_time": ...}   after every step
  {"type": "resume", "step": S, "source": "disk"|"none", "restore_ms": ..., "unix_time": ...}
the resume line once the state is restored, on every restart (source "none", step 0, when
no checkpoint had been written yet).

With --fsdprun_snapshot_every N (under fsdprun): the same script with fsdprun's Python module, as
a PyTorch user adds it: fsdprun.restore() on a start (source "memory" or "peer copy"),
mark_progress every step and fsdprun.snapshot() every N steps."""
import argparse
import glob
import json
import os
import re
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fashion_mnist import load, net  # noqa: E402


def process_age():
    """Seconds since this process started (/proc/self/stat field 22 against /proc/uptime)."""
    with open("/proc/self/stat") as f:
        stat = f.read()
    ticks = int(stat[stat.rfind(")") + 2:].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - ticks / os.sysconf("SC_CLK_TCK")


def newest_checkpoint(directory):
    """(step, path) of the newest complete checkpoint, or (0, None)."""
    best = (0, None)
    for path in glob.glob(os.path.join(directory, "step_*.pt")):
        m = re.fullmatch(r"step_(\d+)\.pt", os.path.basename(path))
        if m and int(m.group(1)) > best[0]:
            best = (int(m.group(1)), path)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--model", default="deep")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--checkpoint_every", type=int, default=10)
    ap.add_argument("--checkpoint_dir", required=True)
    ap.add_argument("--metrics_file", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fsdprun_snapshot_every", type=int, default=-1,
                    help="under fsdprun: resume with fsdprun.restore(), mark progress every step and "
                         "fsdprun.snapshot() every N steps (0: none); -1: the torchrun recipe alone")
    args = ap.parse_args()
    torch.set_num_threads(1)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = load(args.data, True)
    torch.manual_seed(args.seed)
    model = nn.parallel.DistributedDataParallel(net(args.model == "deep", dropout=False))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # Every rank reads the newest checkpoint rank 0 wrote (one file system: one machine).
    restore_start = time.time()  # restore_ms: the load alone, as the trainer's
    start, path = newest_checkpoint(args.checkpoint_dir)
    source = "disk" if path else "none"
    module = None
    if args.fsdprun_snapshot_every >= 0:
        import fsdprun as module  # the agent put it on PYTHONPATH
        restored = module.restore()
        if restored is not None:
            start, state = restored
            model.module.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            source, path = module.restored_from(), None
    if path is not None:
        state = torch.load(path, map_location="cpu")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    dist.barrier()
    metrics = open(args.metrics_file, "a") if rank == 0 else None

    def write(line):
        metrics.write(json.dumps(line) + "\n")
        metrics.flush()

    if rank == 0 and restart > 0:
        write({"type": "resume", "step": start, "source": source,
               "restore_ms": 1000.0 * (time.time() - restore_start), "process_age_s": process_age(),
               "unix_time": time.time()})
    g = torch.Generator().manual_seed(args.seed + 1)
    perm = torch.randperm(x.shape[0], generator=g)
    local = args.batch_size // world
    for step in range(start + 1, args.steps + 1):
        begin = time.perf_counter()
        at = ((step - 1) * args.batch_size) % (x.shape[0] - args.batch_size)
        idx = perm[at + rank * local: at + (rank + 1) * local]
        opt.zero_grad()
        loss = F.nll_loss(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        if rank == 0 and args.checkpoint_every > 0 and step % args.checkpoint_every == 0:
            # Written aside and renamed: a kill during the write leaves the previous one whole.
            tmp = os.path.join(args.checkpoint_dir, f".step_{step}.pt.tmp")
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "step": step}, tmp)
            os.replace(tmp, os.path.join(args.checkpoint_dir, f"step_{step}.pt"))
        if module is not None:
            module.mark_progress(step)
            if args.fsdprun_snapshot_every > 0 and step % args.fsdprun_snapshot_every == 0:
                module.snapshot(step, {"model": model.module.state_dict(), "optimizer": opt.state_dict()})
        if rank == 0:
            write({"type": "train", "step": step, "loss": loss.item(),
                   "step_time_ms": 1000.0 * (time.perf_counter() - begin), "unix_time": time.time()})
    dist.barrier()
    if rank == 0:
        print(json.dumps({"steps": args.steps, "world_size": world, "restarts": restart}), flush=True)


if __name__ == "__main__":
    main()
