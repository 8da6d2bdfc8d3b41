"""PyTorch's own torch.distributed.TCPStore client against a store server (fsdprun-rdzv).

  store_client.py HOST PORT [--libuv 0|1] [--compare]

Runs every operation this PyTorch's client has, each checked against what c10d's own server
answers; an operation this PyTorch lacks is listed as absent (1.13 has no append, multi_get,
check, queue_*...). --compare runs them first against this PyTorch's own server (libuv or the
classic backend, as --libuv says), so that an expectation of this script that PyTorch itself
does not meet is told apart from a fault of the server under test. An operation the client
itself refuses (NotImplementedError: 2.x's classic backend has no queues) counts as absent. Prints one line per
operation and a last line `python TCPStore ok: torch V, libuv L, N operations (absent: ...)`.
Exit: 0 ok; 1 the server under test failed an operation (named); 3 only the script's
expectations were wrong (PyTorch's own server fails them too).
"""
import argparse
import datetime
import sys
import uuid

import torch
import torch.distributed as dist


def client(host, port, libuv):
    """A client of world size 1 that waits for nobody; use_libuv where this PyTorch has it (2.2+)."""
    kwargs = {"timeout": datetime.timedelta(seconds=10), "wait_for_workers": False}
    try:
        return dist.TCPStore(host, port, 1, False, use_libuv=bool(libuv), **kwargs), True
    except TypeError:  # an older PyTorch: no use_libuv argument
        return dist.TCPStore(host, port, 1, False, **kwargs), False


def master(libuv):
    """This PyTorch's own TCPStore server on a free loopback port (libuv or the classic backend)."""
    kwargs = {"timeout": datetime.timedelta(seconds=10), "wait_for_workers": False}
    try:
        return dist.TCPStore("127.0.0.1", 0, 1, True, use_libuv=bool(libuv), **kwargs)
    except TypeError:
        return dist.TCPStore("127.0.0.1", 0, 1, True, **kwargs)


def run_ops(store):
    """Every operation this client has, against one server: {name: "ok" | "absent" | "FAILED: ..."}."""
    results = {}
    run = uuid.uuid4().hex[:8]  # keys of their own: a server may serve several runs of this

    def k(name):
        return f"{run}/{name}"

    def op(name, fn):
        if not all(hasattr(store, part) for part in name.split("+")):
            results[name] = "absent"
            return
        try:
            fn()
            results[name] = "ok"
        except NotImplementedError as e:
            # The client itself refuses it (2.x's classic backend has no queues): not the server's.
            results[name] = "absent"
            print(f"  {name}: absent in this client: {e}")
        except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the rest
            results[name] = f"FAILED: {type(e).__name__}: {e}"

    def expect(got, want, what):
        if got != want:
            raise AssertionError(f"{what}: got {got!r}, expected {want!r}")

    def set_get():
        store.set(k("k"), "v1")
        expect(store.get(k("k")), b"v1", "get after set")
        store.set(k("bin"), bytes(range(256)))
        expect(store.get(k("bin")), bytes(range(256)), "binary value")

    def add():
        expect(store.add(k("c"), 5), 5, "add to a new key")
        expect(store.add(k("c"), -2), 3, "add -2")
        expect(store.get(k("c")), b"3", "the counter as text")

    def compare_set():
        expect(store.compare_set(k("k"), "v1", "v2"), b"v2", "compare_set that matches")
        expect(store.compare_set(k("k"), "zz", "v3"), b"v2", "compare_set that does not match")
        expect(store.compare_set(k("fresh"), "", "new"), b"new", "compare_set of a missing key")

    def wait():
        store.wait([k("k"), k("c")])
        try:
            store.wait([k("missing")], datetime.timedelta(milliseconds=200))
        except RuntimeError:  # DistStoreError derives from it
            pass
        else:
            raise AssertionError("wait for a missing key did not time out")
        expect(store.get(k("k")), b"v2", "a request after a timed-out wait")

    def num_keys_delete():
        before = store.num_keys()
        store.set(k("gone"), "x")
        expect(store.num_keys(), before + 1, "num_keys after a set")
        expect(store.delete_key(k("gone")), True, "delete_key of a key")
        expect(store.delete_key(k("gone")), False, "delete_key of a deleted key")
        expect(store.num_keys(), before, "num_keys after the delete")

    def check():
        expect(store.check([k("k"), k("c")]), True, "check of present keys")
        expect(store.check([k("k"), k("absent")]), False, "check with a missing key")

    def append():
        store.append(k("log"), "a")
        store.append(k("log"), "bc")
        expect(store.get(k("log")), b"abc", "two appends")

    def multi():
        store.multi_set([k("m1"), k("m2")], ["x", "yy"])
        expect(store.multi_get([k("m1"), k("m2"), k("k")]), [b"x", b"yy", b"v2"], "multi_get")

    def list_keys():
        keys = set(store.list_keys())
        missing = {k("k"), k("c"), k("m1")} - keys
        if missing:
            raise AssertionError(f"list_keys lacks {sorted(missing)}: {sorted(keys)}")

    def queue():
        store.queue_push(k("q"), "first")
        store.queue_push(k("q"), "second")
        expect(store.queue_len(k("q")), 2, "queue_len")
        expect(store.queue_pop(k("q")), b"first", "queue_pop (FIFO)")
        expect(store.queue_pop(k("q")), b"second", "queue_pop again")
        expect(store.queue_len(k("q")), 0, "queue_len when empty")

    def set_timeout():
        store.set_timeout(datetime.timedelta(seconds=5))
        expect(store.get(k("k")), b"v2", "get after set_timeout")

    op("set+get", set_get)
    op("add", add)
    op("compare_set", compare_set)
    op("wait", wait)
    op("num_keys+delete_key", num_keys_delete)
    op("check", check)
    op("append", append)
    op("multi_set+multi_get", multi)
    op("list_keys", list_keys)
    op("queue_push+queue_pop+queue_len", queue)
    op("set_timeout", set_timeout)
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--libuv", type=int, choices=(0, 1), default=1)
    parser.add_argument("--compare", action="store_true",
                        help="first run every operation against this PyTorch's own server (the "
                             "reference); an operation failing there too is the script's error")
    args = parser.parse_args()
    reference = {}
    server = None
    if args.compare:
        try:
            server = master(args.libuv)
            reference = run_ops(client("127.0.0.1", server.port, args.libuv)[0])
        except Exception as e:  # noqa: BLE001 - ours is still worth running; said below
            print(f"  PyTorch's own server (use_libuv={args.libuv}) could not be used: "
                  f"{type(e).__name__}: {e}")
    store, supports_libuv = client(args.host, args.port, args.libuv)
    results = run_ops(store)
    libuv = args.libuv if supports_libuv else "n/a"
    failed, script_errors = [], []
    for name, result in results.items():
        ref = reference.get(name)
        note = f" (PyTorch's own server: {ref})" if ref is not None and ref != result else ""
        print(f"  {name}: {result}{note}")
        if result.startswith("FAILED"):
            (script_errors if ref is not None and ref.startswith("FAILED") else failed).append(name)
        elif ref is not None and ref.startswith("FAILED"):
            script_errors.append(name)
    absent = [n for n, r in results.items() if r == "absent"]
    ran = len(results) - len(absent)
    versus = ", same as PyTorch's own server" if reference and not script_errors else ""
    if script_errors:
        print(f"  the script's expectations differ from PyTorch's own server: {', '.join(script_errors)}")
    if failed:
        print(f"python TCPStore FAILED: torch {torch.__version__}, libuv {libuv}: {', '.join(failed)}")
        return 1
    print(f"python TCPStore ok: torch {torch.__version__}, libuv {libuv}, {ran} operations{versus}"
          f" (absent: {', '.join(absent) or 'none'})")
    return 0 if not script_errors else 3


if __name__ == "__main__":
    sys.exit(main())
