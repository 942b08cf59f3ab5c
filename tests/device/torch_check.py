"""ringd.torch on a GPU, as a PyTorch user runs it: two ringds on 127.0.0.1 as two hosts, 2 and 4
trainer processes on the one GPU, init_process_group("ringd"), CUDA tensors. Phases:
  ops-2, ops-4  every dtype x op on CUDA tensors (views with guard bytes on both sides, a strided
                view, 1 to 20M elements), through dist.all_reduce (sync and async) and the comm
                hook's path, reduce_scatter_tensor / all_gather_into_tensor (apart and in
                place), broadcast and reduce (roots on every rank), all_to_all_single of equal
                blocks and of uneven split sizes, the list forms of all_to_all and all_gather;
                every value and guard byte checked on the host
  ddp           DDP, 20 steps of the reference MLP and of a small CNN: over Gloo's CUDA path, over
                ringd, over ringd with allreduce_hook; losses against Gloo's, parameters identical on
                every rank; step times side by side
  time-2, time-4  a 256 MiB float32 CUDA allreduce, ringd vs Gloo, same processes, medians
  kill          a rank dies during a 256 MiB op: the others get RuntimeError within timeouts.op +
                margin, and their streams are not left waiting (torch.cuda.synchronize returns)
Launcher: torch_check.py --out DIR --bin DIR [--device cuda|cpu] [--phases a,b]. --device cpu runs
the same phases on CPU tensors (a check of this script where there is no GPU). Writes
DIR/torch-check.json; exit 0 when every phase passed.
Worker (internal): torch_check.py --worker PHASE DIR."""
import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OP_TIMEOUT_S = 10
PHASES = {"ops-2": 2, "ops-4": 4, "ddp": 4, "time-2": 2, "time-4": 4, "kill": 4}


# ---------------------------------------------------------------- worker

def worker(phase, out):
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    import ringd.torch  # noqa: F401  (registers "ringd")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device(os.environ.get("CHECK_DEVICE", "cuda"))
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    rep = {"rank": rank, "phase": phase, "failures": [], "checked": 0}

    def fail(msg):
        if len(rep["failures"]) < 20:
            rep["failures"].append(msg)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def write():
        with open(os.path.join(out, f"{phase}-rank{rank}.json"), "w") as f:
            json.dump(rep, f)

    dist.init_process_group("ringd", timeout=datetime.timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")
    try:
        {"ops": phase_ops, "ddp": phase_ddp, "time": phase_time, "kill": phase_kill}[phase.split("-")[0]](
            torch, dist, rank, world, dev, sync, fail, rep, gloo, write)
    except Exception as e:  # the phase's own failure, reported
        import traceback
        fail(f"{type(e).__name__}: {e}")
        rep["traceback"] = traceback.format_exc()[-2000:]
    write()
    if phase != "kill":
        dist.barrier(group=gloo)
        dist.destroy_process_group()
    os._exit(0)


def _ringd_status_staged():
    """The bytes this host's ringd copied off and onto devices so far."""
    import ringd
    c = ringd.status().get("cuda") or {}
    return c.get("staged_in_bytes", 0) + c.get("staged_out_bytes", 0)


DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
OPS = ["sum", "avg", "min", "max"]


def phase_ops(torch, dist, rank, world, dev, sync, fail, rep, gloo, write):
    red = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    guard_n = 4096

    def inputs(dtype, n, r, salt):
        i = torch.arange(n, dtype=torch.int64)
        # Multiples of the world size, small: every sum and mean exact in every dtype.
        return (((i * 7 + salt) % 29 + r * 5) * world).to(getattr(torch, dtype))

    def expect(dtype, op, n, salt):
        s = torch.stack([inputs(dtype, n, r, salt).double() for r in range(world)])
        ref = {"sum": s.sum(0), "avg": s.mean(0), "min": s.min(0).values, "max": s.max(0).values}[op]
        return ref.to(getattr(torch, dtype))

    def one(dtype, op, n, salt, mode):
        t = getattr(torch, dtype)
        big = torch.full((2 * guard_n + 2 * n,), 3, dtype=t, device=dev)
        mine = inputs(dtype, n, rank, salt).to(dev)
        if mode == "strided":  # every other element of a range: not contiguous
            view = big[guard_n:guard_n + 2 * n:2]
        else:
            view = big[guard_n:guard_n + n]
        view.copy_(mine)
        if mode == "async":
            w = dist.all_reduce(view, red[op], async_op=True)
            w.wait()  # the current stream waits; the host does not
        result = None
        if mode == "hook":
            # The comm hook's path: the future's value is the result (a CUDA bucket: in place;
            # a CPU bucket: its range of the slot).
            pg = dist.distributed_c10d._get_default_group()
            result = pg.hook_allreduce(0, view).wait()
        elif mode == "async":
            pass
        else:
            dist.all_reduce(view, red[op])
        host = big.cpu()  # on the current stream, after the result
        got = host[guard_n:guard_n + 2 * n:2] if mode == "strided" else host[guard_n:guard_n + n]
        if result is not None:
            got = result.cpu()
        want = expect(dtype, op, n, salt)
        wrong = int((got != want).sum())
        if mode == "strided":
            between = host[guard_n + 1:guard_n + 2 * n:2]
            guard = int((between != 3).sum() + (host[:guard_n] != 3).sum() + (host[guard_n + 2 * n:] != 3).sum())
        else:
            guard = int((host[:guard_n] != 3).sum() + (host[guard_n + n:] != 3).sum())
        rep["checked"] += n
        if wrong or guard:
            fail(f"{mode} {dtype} {op} n={n}: {wrong} wrong values, {guard} guard elements changed")

    def collective(dtype, op, n, salt, in_place):
        """reduce_scatter_tensor (op) or all_gather_into_tensor (op "gather") of blocks of n
        elements inside one guarded tensor: the input and output apart, or the output this rank's
        block of the input (reduce_scatter), the input its block of the output (allgather)."""
        t = getattr(torch, dtype)
        gather = op == "gather"
        n_in, n_out = (n, world * n) if gather else (world * n, n)
        big = torch.full((3 * guard_n + n_in + n_out,), 3, dtype=t, device=dev)
        if not in_place:
            inp = big[guard_n:guard_n + n_in]
            out = big[2 * guard_n + n_in:2 * guard_n + n_in + n_out]
        elif gather:
            out = big[guard_n:guard_n + n_out]
            inp = out[rank * n:(rank + 1) * n]
        else:
            inp = big[guard_n:guard_n + n_in]
            out = inp[rank * n:(rank + 1) * n]
        if gather:
            inp.copy_(inputs(dtype, n, rank, salt).to(dev))
            dist.all_gather_into_tensor(out, inp)
            want = torch.cat([inputs(dtype, n, r, salt) for r in range(world)])
        else:
            inp.copy_(inputs(dtype, n_in, rank, salt).to(dev))
            dist.reduce_scatter_tensor(out, inp, red[op])
            want = expect(dtype, op, n_in, salt)[rank * n:(rank + 1) * n]
        host = big.cpu()  # on the current stream, after the result
        base = out.storage_offset() - big.storage_offset()
        got = host[base:base + n_out]
        wrong = int((got != want).sum())
        # Outside the output: the guards, and the input where it lies apart (read only).
        outside = torch.cat([host[:base], host[base + n_out:]])
        kept = big.new_full(big.shape, 3).cpu()
        if not in_place or not gather:
            ib = inp.storage_offset() - big.storage_offset()
            kept[ib:ib + n_in] = (inputs(dtype, n, rank, salt) if gather else inputs(dtype, n_in, rank, salt))
        kept_outside = torch.cat([kept[:base], kept[base + n_out:]])
        changed = int((outside != kept_outside).sum())
        rep["checked"] += n_out
        if wrong or changed:
            fail(f"{'all_gather_into_tensor' if gather else 'reduce_scatter_tensor ' + op} {dtype} n={n}"
                 f"{' in place' if in_place else ''}: {wrong} wrong values, {changed} elements changed outside the output")

    def rooted(dtype, op, n, salt, root, strided=False):
        """broadcast (op "bcast") or reduce (op; "premul": PREMUL_SUM(0.5)) from or to `root` of n
        elements inside a guarded tensor (`strided`: every other element of it, the rest guards):
        every rank's becomes the root's (broadcast), the root's the reduction (reduce); the
        buffers the op only reads and the guards unchanged."""
        t = getattr(torch, dtype)
        step = 2 if strided else 1
        big = torch.full((2 * guard_n + step * n,), 3, dtype=t, device=dev)
        buf = big[guard_n:guard_n + step * n:step]
        buf.copy_(inputs(dtype, n, rank, salt).to(dev))
        if op == "bcast":
            dist.broadcast(buf, src=root)
            want = inputs(dtype, n, root, salt)
        elif op == "premul":
            dist.reduce(buf, dst=root, op=dist._make_nccl_premul_sum(0.5))
            want = (expect(dtype, "sum", n, salt).double() * 0.5).to(t) if rank == root else inputs(dtype, n, rank, salt)
        else:
            dist.reduce(buf, dst=root, op=red[op])
            want = expect(dtype, op, n, salt) if rank == root else inputs(dtype, n, rank, salt)
        host = big.cpu()
        body = host[guard_n:guard_n + step * n:step]
        wrong = int((body != want).sum())
        keep = torch.ones(host.shape, dtype=torch.bool)
        keep[guard_n:guard_n + step * n:step] = False
        changed = int((host[keep] != 3).sum())
        rep["checked"] += n
        if wrong or changed:
            fail(f"{'broadcast' if op == 'bcast' else 'reduce ' + op} {dtype} n={n} root {root}: {wrong} wrong values, "
                 f"{changed} guard elements changed")

    salt = 0
    for dtype in DTYPES:
        for op in OPS:
            if op == "avg" and dtype.startswith("int"):
                continue
            for n in (1, 1000, 300_001):
                salt += 1
                one(dtype, op, n, salt, "sync")
            salt += 1
            one(dtype, op, 4097, salt, "async")
        if not dtype.startswith("int"):
            salt += 1
            one(dtype, "avg", 100_003, salt, "hook")
    # reduce_scatter_tensor and all_gather_into_tensor (FSDP2's collectives): every dtype x op, a
    # block of 1 to 300001 elements per rank, apart and in place, guard elements around each.
    for dtype in DTYPES:
        for op in OPS + ["gather"]:
            if op == "avg" and dtype.startswith("int"):
                continue
            for n in (1, 1000, 300_001):
                for in_place in (False, True):
                    salt += 1
                    collective(dtype, op, n, salt, in_place)
    # broadcast and reduce (ZeRO's and DDP's broadcasts): every dtype x op, roots on every rank,
    # strided views, PREMUL_SUM; through ringd's CUDA path (its ringd stages their bytes)
    cuda = dev.type == "cuda"
    staged0 = _ringd_status_staged() if cuda else 0
    for dtype in DTYPES:
        for op in OPS + ["bcast"]:
            if op == "avg" and dtype.startswith("int"):
                continue
            for n in (1000, 300_001, 20_000_000 if dtype == "float32" and op in ("sum", "bcast") else 0):
                if n:
                    salt += 1
                    rooted(dtype, op, n, salt, salt % world)
    for op in ("bcast", "sum", "premul"):
        salt += 1
        rooted("float32", op, 50_000, salt, salt % world, strided=True)
    if cuda and _ringd_status_staged() == staged0:
        fail("broadcast and reduce of CUDA tensors staged nothing through ringd (they went another way)")
    # all_to_all_single of equal blocks (capacity-padded MoE): every dtype, without split sizes
    # and with equal ones (both ringd's CUDA path); output block q is rank q's block for this rank
    staged0 = _ringd_status_staged() if cuda else 0
    for dtype in DTYPES:
        for n, splits in ((1000, False), (300_001, False), (4097, True)):
            salt += 1
            t = getattr(torch, dtype)
            big = torch.full((2 * guard_n + world * n,), 3, dtype=t, device=dev)
            out = big[guard_n:guard_n + world * n]
            inp = inputs(dtype, world * n, rank, salt).to(dev)
            sizes = [n] * world if splits else None
            dist.all_to_all_single(out, inp, sizes, sizes)
            want = torch.cat([inputs(dtype, world * n, q, salt)[rank * n:(rank + 1) * n] for q in range(world)])
            host = big.cpu()
            wrong = int((host[guard_n:guard_n + world * n] != want).sum())
            changed = int((host[:guard_n] != 3).sum() + (host[guard_n + world * n:] != 3).sum())
            rep["checked"] += world * n
            if wrong or changed:
                fail(f"all_to_all_single {dtype} n={n}{' splits' if splits else ''}: {wrong} wrong values, "
                     f"{changed} guard elements changed")
    salt += 1
    rooted("float32", "premul", 4097, salt, salt % world)
    if cuda and _ringd_status_staged() == staged0:
        fail("all_to_all_single of CUDA tensors staged nothing through ringd (it went another way)")
    # all_to_all_single with uneven split sizes (zeros among them; mixture-of-experts' routing) and
    # the list forms of all_to_all and all_gather, all through ringd's CUDA path
    staged0 = _ringd_status_staged() if cuda else 0
    for dtype in DTYPES:
        salt += 1
        t = getattr(torch, dtype)

        def size(q, r):  # rows rank q sends rank r, 2 elements a row
            return 0 if (q + 2 * r + salt) % 4 == 0 else 1 + (q * 301 + r * 97 + salt * 13) % 3000
        ins = [size(rank, r) for r in range(world)]
        outs = [size(q, rank) for q in range(world)]
        big = torch.full((2 * guard_n + 2 * sum(outs),), 3, dtype=t, device=dev)
        out = big[guard_n:guard_n + 2 * sum(outs)].view(-1, 2)
        inp = inputs(dtype, 2 * sum(ins), rank, salt).to(dev).view(-1, 2)
        dist.all_to_all_single(out, inp, outs, ins)
        want = torch.cat([inputs(dtype, 2 * sum(size(q, r) for r in range(world)), q, salt)
                          [2 * sum(size(q, r) for r in range(rank)):][:2 * outs[q]] for q in range(world)])
        host = big.cpu()
        wrong = int((host[guard_n:guard_n + 2 * sum(outs)] != want).sum())
        changed = int((host[:guard_n] != 3).sum() + (host[guard_n + 2 * sum(outs):] != 3).sum())
        rep["checked"] += 2 * sum(outs)
        if wrong or changed:
            fail(f"all_to_all_single {dtype} with split sizes: {wrong} wrong values, {changed} guard elements changed")
        outl = [torch.full((2 * outs[q],), 3, dtype=t, device=dev) for q in range(world)]
        dist.all_to_all(outl, list(inp.reshape(-1).split([2 * k for k in ins])))
        if not all(torch.equal(o.cpu(), w) for o, w in zip(outl, want.split([2 * k for k in outs]))):
            fail(f"all_to_all (list form) {dtype}: wrong values")
        gathered = [torch.full((777,), 3, dtype=t, device=dev) for _ in range(world)]
        dist.all_gather(gathered, inputs(dtype, 777, rank, salt).to(dev))
        if not all(torch.equal(o.cpu(), inputs(dtype, 777, q, salt)) for q, o in enumerate(gathered)):
            fail(f"all_gather (list form) {dtype}: wrong values")
        rep["checked"] += 2 * sum(outs) + 777 * world
    if cuda and _ringd_status_staged() == staged0:
        fail("all_to_all with split sizes and the list forms of CUDA tensors staged nothing through ringd")
    # One larger than the group's staging range (a quarter of the 256 MiB slot) on rank 0 only: it
    # goes through host memory there and staged on the others, the same ringd op, exact
    salt += 1
    big = 10_000_000 if rank == 0 else 0  # rows of 2 floats rank 0 sends every rank (80 MB each way on it)
    ins = [big + 1000 * (r + 1) for r in range(world)] if rank == 0 else [1000 * (rank + r + 1) for r in range(world)]
    sent = {q: ([10_000_000 + 1000 * (r + 1) for r in range(world)] if q == 0 else [1000 * (q + r + 1) for r in range(world)])
            for q in range(world)}
    outs = [sent[q][rank] for q in range(world)]
    inp = inputs("float32", 2 * sum(ins), rank, salt).to(dev).view(-1, 2)
    out = torch.full((sum(outs), 2), 3.0, device=dev)
    dist.all_to_all_single(out, inp, outs, ins)
    want = torch.cat([inputs("float32", 2 * sum(sent[q]), q, salt)[2 * sum(sent[q][:rank]):][:2 * outs[q]]
                      for q in range(world)])
    if not torch.equal(out.reshape(-1).cpu(), want):
        fail("all_to_all_single with split sizes larger than the staging range: wrong values")
    rep["checked"] += 2 * sum(outs)
    one("float32", "sum", 50_000, 901, "strided")
    one("float32", "sum", 20_000_000, 902, "sync")  # 80 MB: parts through the staging range
    one("float32", "avg", 20_000_000, 903, "hook")
    sync()


def reference_mlp(torch):
    torch.manual_seed(1234)
    sizes = [2048, 4096, 4096, 1024]  # bench/ddp's reference MLP
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def small_cnn(torch):
    torch.manual_seed(4321)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64 * 8 * 8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def phase_ddp(torch, dist, rank, world, dev, sync, fail, rep, gloo, write):
    import ringd.torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    if dev.type == "cuda":
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

    def batch(kind, step):
        g = torch.Generator().manual_seed(1000 * step + rank)
        if kind == "mlp":
            return torch.randn(32, 2048, generator=g).to(dev), torch.randn(32, 1024, generator=g).to(dev)
        return torch.randn(32, 3, 32, 32, generator=g).to(dev), torch.randint(0, 10, (32,), generator=g).to(dev)

    def run(kind, backend):
        model = (reference_mlp(torch) if kind == "mlp" else small_cnn(torch)).to(dev)
        ids = [dev.index] if dev.type == "cuda" else None
        if backend == "gloo":
            ddp = DDP(model, device_ids=ids, process_group=gloo)
        else:
            ddp = DDP(model, device_ids=ids)
            if backend == "ringd+hook":
                ddp.register_comm_hook(None, ringd.torch.allreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        losses, times = [], []
        for step in range(20):
            x, y = batch(kind, step)
            sync()
            t0 = time.perf_counter()
            opt.zero_grad()
            out = ddp(x)
            loss = torch.nn.functional.mse_loss(out, y) if kind == "mlp" else torch.nn.functional.cross_entropy(out, y)
            loss.backward()
            opt.step()
            sync()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(everyone, flat, group=gloo)
        same = all(torch.equal(o, flat) for o in everyone)
        return losses, sorted(times[5:])[len(times[5:]) // 2], same

    rep["ddp"] = {}
    for kind in ("mlp", "cnn"):
        res = {b: run(kind, b) for b in ("gloo", "ringd", "ringd+hook")}
        ref = res["gloo"][0]
        entry = {"step_s": {b: round(r[1], 5) for b, r in res.items()}, "final_loss": {b: r[0][-1] for b, r in res.items()}}
        for b in ("ringd", "ringd+hook"):
            losses, _, same = res[b]
            worst = max(abs(a - g) / max(abs(g), 1e-6) for a, g in zip(losses, ref))
            entry[f"max_rel_loss_diff_{b}"] = worst
            if worst > 1e-4:
                fail(f"{kind} {b}: losses differ from Gloo's by up to {worst:.2e} (relative)")
            if not same:
                fail(f"{kind} {b}: parameters differ between ranks")
        rep["ddp"][kind] = entry


def phase_time(torch, dist, rank, world, dev, sync, fail, rep, gloo, write):
    n = (256 << 20) // 4
    t = torch.ones(n, dtype=torch.float32, device=dev)
    rep["time"] = {}
    for name, group in (("gloo", gloo), ("ringd", None), ("gloo", gloo), ("ringd", None)):
        times = []
        for k in range(4):
            t.fill_(1.0)
            sync()
            dist.barrier(group=gloo)
            t0 = time.perf_counter()
            dist.all_reduce(t, group=group)
            sync()
            times.append(time.perf_counter() - t0)
            if k == 0:
                wrong = int((t != world).sum())
                rep["checked"] += n
                if wrong:
                    fail(f"{name} 256 MiB: {wrong} wrong values")
        rep["time"].setdefault(name, []).extend(times[1:])
    for name in list(rep["time"]):
        v = sorted(rep["time"][name])
        rep["time"][name] = {"median_s": round(v[len(v) // 2], 5), "all_s": [round(x, 5) for x in v]}


def phase_kill(torch, dist, rank, world, dev, sync, fail, rep, gloo, write):
    n = (256 << 20) // 4
    t = torch.ones(n, dtype=torch.float32, device=dev)
    for _ in range(2):
        dist.all_reduce(t)
    sync()
    dist.barrier(group=gloo)
    if rank == world - 1:
        dist.all_reduce(t, async_op=True)
        time.sleep(0.05)  # its parts are in ringd: the op is under way
        rep["died"] = True
        write()
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    w = dist.all_reduce(t, async_op=True)
    try:
        w.wait()  # a CUDA op: the stream waits, the host does not
        sync()  # must return: the stream is released when the op fails
        rep["stream_released_s"] = round(time.monotonic() - t0, 2)
        w.get_future().wait()
        fail("the op with a dead rank succeeded")
    except RuntimeError as e:
        rep["error"] = str(e)[:300]
    rep["failed_after_s"] = round(time.monotonic() - t0, 2)
    if rep["failed_after_s"] > OP_TIMEOUT_S + 12:
        fail(f"the op with a dead rank failed only after {rep['failed_after_s']} s (timeouts.op {OP_TIMEOUT_S} s)")


# ---------------------------------------------------------------- launcher

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--bin", required=True, help="folder with ringd (and lib/ with libringd-client.so.0)")
    ap.add_argument("--lib", default=None, help="libringd-client.so (default: BIN/lib/libringd-client.so.0)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--deadline", type=float, default=420, help="seconds for all phases")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    summary = {"device": args.device, "phases": {}, "ok": False}
    try:
        import torch
        summary["torch"] = torch.__version__
        summary["torch_cuda"] = torch.version.cuda
        if args.device == "cuda":
            if not torch.cuda.is_available():
                summary["error"] = "torch sees no GPU"
                return finish(summary, args.out, 77)
            summary["gpu"] = torch.cuda.get_device_name(0)
    except ImportError as e:
        summary["error"] = f"no torch: {e}"
        return finish(summary, args.out, 77)
    tmp = tempfile.mkdtemp(prefix="ringd-torch-check-")
    lib = args.lib or os.path.join(args.bin, "lib", "libringd-client.so.0")
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
    os.environ["RINGD_CLIENT_LIBRARY"] = lib
    import ringd
    from loopback_ring import LoopbackRing
    env = dict(os.environ)
    if os.environ.get("RINGD_LD_LIBRARY_PATH"):  # the bundle's libraries (tests/device/torch-check)
        env["LD_LIBRARY_PATH"] = os.environ["RINGD_LD_LIBRARY_PATH"]
    ring = None
    try:
        ring = LoopbackRing(os.path.join(args.bin, "ringd"), tmp, 2, log_dir=args.out, env=env, cluster="torchcheck",
                            yaml=f"memory: {{slot_bytes: 256MiB, max_slots: 16}}\ntimeouts: {{op: {OP_TIMEOUT_S}s}}\n"
                                 "cuda: {provider: hardware}\n")
        if not ring.wait_up(20):
            summary["error"] = "the two ringds did not form a ring within 20 s (see node*.log)"
            return finish(summary, args.out, 1)
        st = ringd.status(ring.sockets[0], 1000)
        summary["ringd_cuda"] = st.get("cuda")
        ok = True
        for phase in args.phases.split(","):
            left = args.deadline - (time.monotonic() - start)
            if left < 20:
                summary["phases"][phase] = {"ok": False, "skipped": "out of time"}
                ok = False
                continue
            res = run_phase(phase, PHASES[phase], ring.sockets, args, lib, left)
            summary["phases"][phase] = res
            ok = ok and res["ok"]
            print(f"torch-check: {phase}: {'ok' if res['ok'] else 'FAILED'} in {res['seconds']} s", flush=True)
        times = {p: summary["phases"][p].get("time") for p in ("time-2", "time-4") if p in summary["phases"]}
        summary["timings"] = {p: v for p, v in times.items() if v}
        if "ddp" in summary["phases"]:
            summary["timings"]["ddp_step_s"] = summary["phases"]["ddp"].get("ddp")
        summary["ok"] = ok
        return finish(summary, args.out, 0 if ok else 1)
    finally:
        if ring is not None:
            ring.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def run_phase(phase, world, sockets, args, lib, left):
    t0 = time.monotonic()
    from loopback_ring import free_port
    port = free_port()
    procs = []
    for r in range(world):
        local_size = world // 2
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r % local_size),
                   LOCAL_WORLD_SIZE=str(local_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   RINGD_SOCKET=sockets[r // local_size], RINGD_CLIENT_LIBRARY=lib,
                   CHECK_DEVICE=args.device, GLOO_SOCKET_IFNAME="lo", CUBLAS_WORKSPACE_CONFIG=":4096:8",
                   PYTHONUNBUFFERED="1")
        log = open(os.path.join(args.out, f"{phase}-rank{r}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", phase, args.out], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + min(left, 240)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append("timeout")
    ranks = []
    for r in range(world):
        path = os.path.join(args.out, f"{phase}-rank{r}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path) else {"rank": r, "failures": ["no report"]})
    res = {"world": world, "exit": codes, "seconds": round(time.monotonic() - t0, 1)}
    failures = [f"rank {x['rank']}: {m}" for x in ranks for m in x.get("failures", [])]
    died = [x["rank"] for x in ranks if x.get("died")]
    bad_exit = [r for r, c in enumerate(codes) if c != 0 and r not in died]
    res["ok"] = not failures and not bad_exit
    res["failures"] = failures[:20] + [f"rank {r}: exit {codes[r]}" for r in bad_exit]
    res["checked_values"] = sum(x.get("checked", 0) for x in ranks)
    if phase.startswith("time"):
        res["time"] = {b: max(x["time"][b]["median_s"] for x in ranks if "time" in x) for b in ("ringd", "gloo")
                       if all("time" in x for x in ranks)}
        if res["time"]:
            res["time"]["ringd_over_gloo"] = round(res["time"]["ringd"] / res["time"]["gloo"], 3)
    if phase == "ddp" and all("ddp" in x for x in ranks):
        res["ddp"] = {k: {"step_s": {b: max(x["ddp"][k]["step_s"][b] for x in ranks) for b in ("gloo", "ringd", "ringd+hook")},
                          "max_rel_loss_diff": {b: max(x["ddp"][k][f"max_rel_loss_diff_{b}"] for x in ranks)
                                                for b in ("ringd", "ringd+hook")}}
                      for k in ("mlp", "cnn")}
    if phase == "kill":
        res["kill"] = [{k: x.get(k) for k in ("rank", "error", "failed_after_s", "stream_released_s", "died")} for x in ranks]
    for x in ranks:
        if x.get("traceback"):
            res.setdefault("tracebacks", []).append(x["traceback"])
    return res


def finish(summary, out, code):
    summary["exit"] = code
    with open(os.path.join(out, "torch-check.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))
    return code


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
