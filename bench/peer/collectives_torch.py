"""The torch.distributed side of `fsdp-bench collectives`: Gloo on 2 ranks (env://).
PyTorch 1.13's Gloo has no reduce_scatter and no _allgather_base, so the operations FSDP needs
are done the way PyTorch's own FSDP falls back to: all_reduce then slice, all_gather into a
list then cat."""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", default="1,16,128")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for mb in [int(m) for m in args.mb.split(",")]:
        n = mb * (1 << 20) // 4 // world * world
        full = torch.ones(n)
        shard = torch.ones(n // world)

        def all_gather():
            parts = [torch.empty(n // world) for _ in range(world)]
            dist.all_gather(parts, shard)
            return torch.cat(parts)

        def reduce_scatter():
            t = full.clone()
            dist.all_reduce(t)
            return t.narrow(0, rank * (n // world), n // world).clone()

        def all_reduce():
            t = full.clone()
            dist.all_reduce(t)

        ops = [("all_gather", all_gather, "all_gather list + cat"),
               ("reduce_scatter", reduce_scatter, "all_reduce + slice"),
               ("all_reduce", all_reduce, "all_reduce")]
        for name, fn, method in ops:
            fn()
            times = []
            for _ in range(args.reps):
                dist.barrier()
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1000)
            times.sort()
            median = times[len(times) // 2]
            if rank == 0:
                print(json.dumps({"bench": "collectives", "impl": "torch_gloo", "op": name, "mb": mb,
                                  "ranks": world, "method": method, "ms_median": median,
                                  "gb_per_s": n * 4 / (median * 1e6)}), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
