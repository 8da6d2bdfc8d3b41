"""fsdprun's Python module used wrongly, under fsdprun --nproc_per_node 1 --max_restarts 1
--snapshot_memory_limit 2M: each misuse raises one exception naming the fix, and the snapshot
taken before it is still the one restore() brings back. Prints "bad use ok" or exits 1 naming
what was wrong."""
import sys

import torch
import torch.distributed as dist

import fsdprun


def expect(kind, words, call):
    try:
        call()
    except kind as e:
        if all(w in str(e) for w in words):
            print(f"{kind.__name__}: {e}")
            return None
        return f"{kind.__name__} without {words}: {e}"
    return f"no {kind.__name__} for {words}"


def main() -> int:
    problems = []
    state = {"w": torch.arange(4.0), "step": 1, "name": "a", "nested": [1.5, (2, None)], "nan": float("nan")}
    problems.append(expect(RuntimeError, ["init_process_group()"], lambda: fsdprun.snapshot(1, state)))
    dist.init_process_group("gloo")
    fsdprun.snapshot(1, state)
    problems.append(expect(TypeError, ["state['extra'] is a object", "convert it"],
                           lambda: fsdprun.snapshot(2, {"w": state["w"], "extra": object()})))
    big = {"w": torch.zeros(1 << 20)}  # 4 MiB: over the 2 MiB limit
    problems.append(expect(RuntimeError, ["--snapshot_memory_limit", "taken before are kept"],
                           lambda: fsdprun.snapshot(3, big)))
    restored = fsdprun.restore()
    if restored is None:
        problems.append("restore() found nothing: the snapshot of step 1 went")
    else:
        step, back = restored
        if step != 1 or not torch.equal(back["w"], state["w"]) or back["nested"] != [1.5, (2, None)] \
                or back["name"] != "a" or back["nan"] == back["nan"]:
            problems.append(f"restore() gave step {step} and {back}, not the snapshot of step 1")
    problems = [p for p in problems if p]
    if problems:
        print("bad use FAILED: " + "; ".join(problems), file=sys.stderr)
        return 1
    print("bad use ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
