#!/usr/bin/python3
"""One rank of the PyTorch checks, run on every host x local rank by bench/cluster (torch_check.sh).

    torch_ranks.py SCENARIO   (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT set)

Every rank checks its own results against values it computes itself from every rank's inputs
(which are functions of the rank), never through ringd or torch.distributed. It prints
"torch_ranks: rank R: SCENARIO ok" and exits 0, or fails with the reason.
Scenarios:
  ops      every dtype x op through ringd (SUM, AVG, MIN, MAX; ints without AVG), views and
           non-contiguous tensors with the elements around them untouched, a tensor bigger than a
           quarter of the slot (several ringd ops), empty tensors; what goes to Gloo (PRODUCT,
           uint8) and what is refused (int AVG, non-CPU tensors), with ringd's message
  async    16 allreduces in flight at once, waited for in reverse order, and through get_future()
  ddp      DDP for 8 steps over ringd (default reducer and ringd.torch.allreduce_hook) and over
           Gloo from the same start: the same losses (1e-4 relative), identical parameters on
           every rank
  die      the last rank exits after 3 ops; every other rank gets a RuntimeError naming it
           within ringd's op timeout + 2 s (torch_check.sh then runs "restart" on the same daemons)
  restart  a new job on the same daemons (after "die": the job restarted as torchrun would)
  groups   new_group over ranks on both hosts (one per host, and 1 + 2 ranks: avg over 3) and on
           one host, all through ringd, with each group's ringd group, hosts and local sizes
           checked in ringd's status; the default group after them
  slots    ranks with different RINGD_SLOT_BYTES: large tensors and the comm hook's buckets split
           alike on every rank
  tensors  expanded (stride-0) and overlapping tensors; reduce_scatter, reduce_scatter_tensor,
           all_gather_into_tensor
  collectives  reduce_scatter_tensor, reduce_scatter (list), all_gather_into_tensor, all_gather
           (list) and their coalesced forms through ringd with torch ranks numbered unlike the hosts'
           order: every dtype x op (and PREMUL_SUM), 1 to 70001 elements a block (several ringd ops),
           non-contiguous outputs, inputs left as they were; each counted in ringd's status
  spawn    mp.spawn with init_method tcp:// and file:// (one process that spawns two ranks)
  refused  a new_group one rank cannot join: an error on every rank, no rank left waiting; a
           large tensor of another size on some ranks fails every rank at once, and its group then
           refuses further ops; an all_to_all that does not fit one rank's slot fails it there and
           (ringd_refuse) every other rank at once, and the group's next ops are exact
  (torch_check.sh runs "groups" with two slots per host (memory.max_slots): each process's groups
  share its one slot)
  part     a job on 2 hosts of 4 (torch_check.sh runs two such jobs at once): exact ops of its
           default group, which ringd runs in the ring domain of its hosts, and a short DDP run
"""
import datetime
import faulthandler
import gc
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "client", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import ringd  # noqa: E402
import ringd.torch  # noqa: E402,F401

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
OP_TIMEOUT_S = float(os.environ.get("RINGD_OP_TIMEOUT_S", "20"))
torch.set_num_threads(1)


def fail(msg):
    print(f"torch_ranks: rank {RANK}: FAIL: {msg}", flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def init(port_offset=0):
    os.environ["MASTER_PORT"] = str(int(os.environ.get("MASTER_PORT_BASE", "29500")) + port_offset)
    dist.init_process_group("ringd", rank=RANK, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    check(dist.get_backend() == "ringd", f"backend is {dist.get_backend()}")


def data(rank, n, dtype, salt):
    """Rank `rank`'s input: small integers (exact in every dtype), different per rank and element;
    the sign alternates so that min and max are not the same rank everywhere."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    v = torch.randint(-50, 50, (n,), generator=g)
    return v.to(dtype)


def expected(n, dtype, op, salt):
    xs = torch.stack([data(r, n, torch.float64, salt) for r in range(WORLD)])
    if op == "sum":
        e = xs.sum(0)
    elif op == "avg":
        e = xs.sum(0) / WORLD
    elif op == "min":
        e = xs.min(0).values
    else:
        e = xs.max(0).values
    return e


OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


def close_to(got, want, dtype):
    got = got.to(torch.float64)
    if not dtype.is_floating_point:
        return torch.equal(got, want)
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(dtype, 1e-12)
    return bool(((got - want).abs() <= tol * want.abs().clamp(min=1)).all())


def ringd_ops_completed():
    """This host's ringd's count of completed ops (each op once per host)."""
    return ringd.status()["ops"]["completed"]


def scenario_ops():
    init()
    salt = 1
    before = ringd_ops_completed()
    expected_ops = 0
    for dtype in DTYPES:
        for name, op in OPS.items():
            if name == "avg" and not dtype.is_floating_point:
                continue
            for n in (1, 1000, 70001):
                salt += 1
                t = data(RANK, n, dtype, salt)
                dist.all_reduce(t, op=op)
                want = expected(n, dtype, name, salt)
                if name == "avg":
                    want = want.to(dtype).to(torch.float64)  # rounded once to the dtype
                check(close_to(t, want, dtype), f"{dtype} {name} n={n}: got {t[:4].tolist()}, want {want[:4].tolist()}")
                expected_ops += 1
    # Every one of them went through ringd (none fell back to Gloo).
    ran = ringd_ops_completed() - before
    check(ran >= expected_ops, f"ringd completed {ran} ops, {expected_ops} allreduces were made")
    # A view inside a bigger tensor: its neighbours untouched.
    big = torch.full((3000,), 7.0)
    mid = big[1000:2000]
    mid.copy_(data(RANK, 1000, torch.float32, 99))
    dist.all_reduce(mid)
    check(close_to(mid, expected(1000, torch.float32, "sum", 99), torch.float32), "a view's values")
    check(bool((big[:1000] == 7).all() and (big[2000:] == 7).all()), "elements around a view changed")
    # Non-contiguous (a transposed matrix).
    m = data(RANK, 600, torch.float32, 98).view(20, 30).t()
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    want = expected(600, torch.float32, "max", 98).view(20, 30).t()
    check(close_to(m.contiguous().view(-1), want.contiguous().view(-1), torch.float32), "a transposed tensor")
    # Bigger than a quarter of the slot: several ringd ops.
    slot = int(os.environ.get("RINGD_SLOT_BYTES", str(256 << 20)))
    n = slot // 4 * 3 // 4 + 123
    t = data(RANK, n, torch.float32, 97)
    dist.all_reduce(t)
    check(close_to(t, expected(n, torch.float32, "sum", 97), torch.float32), f"{n} floats in chunks")
    dist.all_reduce(torch.empty(0))
    # A leaf that requires grad (a parameter), as with Gloo: reduced in place, no graph recorded.
    w = torch.full((8,), float(RANK + 1), requires_grad=True)
    dist.all_reduce(w)
    check(bool((w.detach() == WORLD * (WORLD + 1) / 2).all()) and w.grad_fn is None, f"a parameter: {w}")
    loss = (w * 2).sum()
    dist.all_reduce(loss)  # a non-leaf: its value changes, nothing keeps the graph alive in the slot
    check(abs(loss.item() - 2 * 8 * WORLD * WORLD * (WORLD + 1) / 2) < 1e-3, f"a non-leaf: {loss.item()}")
    # Gloo does what ringd does not: PRODUCT, uint8.
    p = torch.full((5,), 2.0)
    dist.all_reduce(p, op=dist.ReduceOp.PRODUCT)
    check(bool((p == 2.0 ** WORLD).all()), f"PRODUCT through Gloo: {p.tolist()}")
    u = torch.full((5,), RANK + 1, dtype=torch.uint8)
    dist.all_reduce(u)
    check(bool((u == WORLD * (WORLD + 1) // 2).all()), f"uint8 SUM through Gloo: {u.tolist()}")
    # Refused with a message, on every rank alike (nothing was submitted).
    for bad, words in ((lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.AVG),
                        "AVG of torch.int32"),
                       (lambda: dist.all_reduce(torch.ones(3, device="meta")), "meta tensors")):
        try:
            bad()
            fail(f"no error for {words}")
        except RuntimeError as e:
            check(words in str(e), f"error for {words}: {e}")
    # The group still works.
    t = torch.full((10,), 1.0)
    dist.all_reduce(t)
    check(bool((t == WORLD).all()), "an allreduce after the refusals")


def scenario_async():
    init()
    works, tensors, wants = [], [], []
    for k in range(16):
        n = 100 + 997 * k
        t = data(RANK, n, torch.float32, 200 + k)
        tensors.append(t)
        wants.append(expected(n, torch.float32, "sum", 200 + k))
        works.append(dist.all_reduce(t, async_op=True))
    for k in reversed(range(16)):
        check(works[k].wait(), f"wait {k}")
        check(close_to(tensors[k], wants[k], torch.float32), f"async op {k}")
    # Futures: the value is the list of tensors, and then() chains.
    t = data(RANK, 4096, torch.float32, 300)
    fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    check(close_to(fut.wait(), expected(4096, torch.float32, "sum", 300) * 2, torch.float32), "get_future().then()")


def model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4))


def train(ddp, steps=8):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(10000 * step + RANK)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def scenario_ddp():
    from torch.nn.parallel import DistributedDataParallel as DDP
    init()
    gloo = dist.new_group(backend="gloo")
    runs = {}
    # Small buckets: several allreduces per step, in flight at once.
    runs["gloo"] = (train(DDP(model(), process_group=gloo, bucket_cap_mb=0.01)), None)
    m = DDP(model(), bucket_cap_mb=0.01)
    runs["ringd"] = (train(m), m)
    h = DDP(model(), bucket_cap_mb=0.01)
    h.register_comm_hook(None, ringd.torch.allreduce_hook)
    runs["ringd+hook"] = (train(h), h)
    ref = runs["gloo"][0]
    for name in ("ringd", "ringd+hook"):
        losses, mod = runs[name]
        for step, (a, b) in enumerate(zip(losses, ref)):
            check(abs(a - b) <= 1e-4 * max(abs(b), 1e-6), f"{name} step {step}: loss {a} vs gloo's {b}")
        # Identical parameters on every rank: gathered through Gloo and compared here.
        flat = torch.cat([p.detach().view(-1) for p in mod.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(WORLD)]
        dist.all_gather(everyone, flat, group=gloo)
        for r, other in enumerate(everyone):
            check(torch.equal(other, flat), f"{name}: rank {r}'s parameters differ from rank {RANK}'s")
    print(f"torch_ranks: rank {RANK}: losses gloo {ref[0]:.6f}..{ref[-1]:.6f}, ringd {runs['ringd'][0][-1]:.6f}, "
          f"hook {runs['ringd+hook'][0][-1]:.6f}", flush=True)


def scenario_die():
    init()
    t = torch.ones(1000)
    for _ in range(3):
        dist.all_reduce(t)
    if RANK == WORLD - 1:
        print(f"torch_ranks: rank {RANK}: die ok (leaving without a word)", flush=True)
        os._exit(0)  # gone mid-job, its process group never destroyed
    start = time.monotonic()
    try:
        for _ in range(3):
            dist.all_reduce(torch.ones(1000))
        fail("no error after a rank died")
    except RuntimeError as e:
        took = time.monotonic() - start
        check("ringd" in str(e), f"the error is not ringd's: {e}")
        check(took <= OP_TIMEOUT_S + 2, f"the error came after {took:.1f} s (op timeout {OP_TIMEOUT_S} s)")
        print(f"torch_ranks: rank {RANK}: after {took:.2f} s: {e}", flush=True)
    dist.destroy_process_group()


def scenario_restart():
    # A new process group (a restarted job, same hosts, same daemons): a fresh ringd group.
    init(port_offset=1)
    t = torch.full((100,), float(RANK))
    dist.all_reduce(t)
    check(bool((t == sum(range(WORLD))).all()), f"after the restart: {t[:3].tolist()}")
    # destroy_process_group lets the ringd group go: once this host's ranks did, ringd forgets it.
    name = dist.distributed_c10d._get_default_group().ringd_group
    dist.destroy_process_group()
    end = time.monotonic() + 10
    while any(g.get("name") == name for g in ringd.status().get("groups", [])):
        check(time.monotonic() < end, f"ringd still has group {name} 10 s after destroy_process_group")
        time.sleep(0.05)


def scenario_groups():
    """new_group: every process group is a ringd group over the hosts of its ranks (2 hosts x 2
    ranks: ranks 0, 1 on the first host, 2, 3 on the second)."""
    init()
    check(WORLD == 4, f"the groups scenario needs 2 hosts x 2 ranks, not {WORLD} ranks")
    layouts = {"cross-a": [0, 2], "cross-b": [1, 3], "uneven": [0, 2, 3], "host0": [0, 1], "host1": [2, 3]}
    groups = {}
    for name, ranks in layouts.items():  # every rank creates every group, in the same order
        # A group's timeout is its ringd group's op timeout (the default group's: init's 60 s).
        groups[name] = dist.new_group(ranks, timeout=datetime.timedelta(seconds=45)) if name == "uneven" else dist.new_group(ranks)
    for k, (name, ranks) in enumerate(layouts.items()):
        if RANK not in ranks:
            continue
        pg, salt = groups[name], 40 + k  # the same sizes on every rank of the group
        for op in ("sum", "avg", "max"):
            n = 5000 + 17 * salt
            t = data(RANK, n, torch.float32, salt)
            dist.all_reduce(t, op=OPS[op], group=pg)
            xs = torch.stack([data(r, n, torch.float64, salt) for r in ranks])
            want = {"sum": xs.sum(0), "avg": xs.sum(0) / len(ranks), "max": xs.max(0).values}[op]
            # A mean over 3 ranks is not exact in float32: within one rounding of the true mean.
            err = ((t.to(torch.float64) - want).abs() / want.abs().clamp(min=1)).max().item()
            check(err <= 2 ** -23, f"group {name} ({ranks}) {op}: got {t[:4].tolist()}, want {want[:4].tolist()}")
        # bfloat16 avg: summed in f32 and rounded once (the mean of integers).
        t = data(RANK, 999, torch.bfloat16, salt)
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg)
        want = (sum(data(r, 999, torch.float64, salt) for r in ranks) / len(ranks)).to(torch.bfloat16)
        check(torch.equal(t, want), f"group {name} bfloat16 avg")
        # Every group through ringd, over the hosts of its ranks (one host: ringd's local path).
        mine = [g for g in ringd.status()["groups"] if g["name"] == pg.ringd_group]
        local = sum(1 for r in ranks if r // 2 == RANK // 2)
        check(len(mine) == 1 and mine[0]["ops_completed"] >= 4 and mine[0]["local_size"] == local,
              f"group {name} on ringd: {mine}")
        check(set(mine[0]["hosts"]) == set(pg.ringd_hosts), f"group {name}'s hosts: {mine[0]['hosts']}")
        if name == "uneven":
            check(mine[0]["op_timeout_ms"] == 45000, f"group {name}'s timeout=45 s reached ringd: {mine[0]['op_timeout_ms']} ms")
        check(len(pg.ringd_hosts) == (1 if name.startswith("host") else 2), f"group {name}: hosts {pg.ringd_hosts}")
    # The default group still works next to them, with init's timeout as its op timeout.
    t = torch.full((10,), 1.0)
    dist.all_reduce(t)
    check(bool((t == WORLD).all()), "the default group after the others")
    world = dist.distributed_c10d._get_default_group()
    name = getattr(world, "ringd_group", None)
    mine = [g for g in ringd.status()["groups"] if g["name"] == name]
    check(len(mine) == 1 and mine[0]["op_timeout_ms"] == 60000, f"the default group's timeout=60 s reached ringd: {mine}")


def scenario_refused():
    """A new_group that one rank cannot join (its RINGD_SOCKET names no ringd): every rank gets a
    RuntimeError naming that rank within seconds (none waits for it); the default group and a
    later new_group still work."""
    init()
    start = time.monotonic()
    good = os.environ["RINGD_SOCKET"]
    if RANK == WORLD - 1:
        os.environ["RINGD_SOCKET"] = "/nonexistent/ringd.sock"
    try:
        dist.new_group(list(range(WORLD)))
        fail("new_group succeeded with a rank that cannot reach ringd")
    except RuntimeError as e:
        took = time.monotonic() - start
        check(f"rank {WORLD - 1}" in str(e) or RANK == WORLD - 1, f"the error does not name rank {WORLD - 1}: {e}")
        check("/nonexistent/ringd.sock" in str(e), f"the error does not give the reason: {e}")
        check(took < 10, f"the error came after {took:.1f} s")
    os.environ["RINGD_SOCKET"] = good
    t = torch.full((100,), 1.0)
    dist.all_reduce(t)
    check(bool((t == WORLD).all()), "the default group after a refused new_group")
    later = dist.new_group(list(range(WORLD)))
    dist.all_reduce(t, group=later)
    check(bool((t == WORLD * WORLD).all()), "a new_group after a refused one")
    # An all_to_all that does not fit rank 0's slot (4 MiB: it receives 3 x 1.6 MB) while the
    # others' does (1.6 MB): rank 0 refuses it in its place (ringd_refuse), naming the slot, so
    # that every other rank's op fails at once too, naming it, rather than at ringd's op timeout;
    # the group goes on: its next all_to_all and all_reduce are exact on every rank.
    a2a = dist.new_group(list(range(WORLD)))
    big, small = 400000, 10
    ins = [big if j == 0 and RANK != 0 else small for j in range(WORLD)]
    outs = [big if RANK == 0 and i != 0 else small for i in range(WORLD)]
    start = time.monotonic()
    try:
        dist.all_to_all_single(torch.empty(sum(outs)), torch.ones(sum(ins)), output_split_sizes=outs,
                               input_split_sizes=ins, group=a2a)
        fail("no error for an all_to_all that does not fit rank 0's slot")
    except RuntimeError as e:
        took = time.monotonic() - start
        check("does not fit" in str(e) if RANK == 0 else "refused it: its all_to_all needs" in str(e),
              f"the all_to_all's error: {e}")
        check(took < OP_TIMEOUT_S / 2, f"the all_to_all failed after {took:.1f} s (op timeout {OP_TIMEOUT_S} s): {e}")
    ins = [RANK * 10 + j + 1 for j in range(WORLD)]
    outs = [i * 10 + RANK + 1 for i in range(WORLD)]
    inp = torch.cat([torch.full((ins[j],), float(RANK * 100 + j)) for j in range(WORLD)])
    out = torch.full((sum(outs),), -1.0)
    dist.all_to_all_single(out, inp, output_split_sizes=outs, input_split_sizes=ins, group=a2a)
    want = torch.cat([torch.full((outs[i],), float(i * 100 + RANK)) for i in range(WORLD)])
    check(torch.equal(out, want), "the all_to_all after a refused one")
    t = torch.full((100,), 1.0)
    dist.all_reduce(t, group=a2a)
    check(bool((t == WORLD).all()), "an all_reduce after a refused all_to_all")
    # A tensor of another size on the odd ranks (a user's error), in several ringd ops: every rank
    # fails at the first piece that does not pair, not after its other pieces waited out ringd's
    # op timeout; the group then takes no more ops (its ranks' pieces no longer pair); the
    # default group goes on.
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(300000 if RANK % 2 == 0 else 600000), group=later)
        fail("no error for tensors of different sizes")
    except RuntimeError as e:
        took = time.monotonic() - start
        check("mismatch" in str(e), f"the error is not the mismatch: {e}")
        check(took < OP_TIMEOUT_S / 2, f"the mismatch failed the op after {took:.1f} s (op timeout {OP_TIMEOUT_S} s)")
    try:
        dist.all_reduce(t, group=later)
        fail("the group took an op after its ranks' pieces stopped pairing")
    except RuntimeError as e:
        check("cannot be used any more" in str(e), f"the next op's error: {e}")
    t = torch.full((100,), 1.0)
    dist.all_reduce(t)
    check(bool((t == WORLD).all()), "the default group after another group's mismatch")


def scenario_part():
    """A job on part of the ring (torch_check.sh runs two at once on 4 hosts, each on 2): its
    default group is a ringd group over its own hosts; exact ops of every dtype, small (direct
    exchange) and large (the ring of its hosts); a short DDP run next to the other job."""
    init()
    st = ringd.status()
    pg = dist.distributed_c10d._get_default_group()
    check(len(st["ring"]["members"]) > len(pg.ringd_hosts) >= 2,
          f"the job's hosts {pg.ringd_hosts}, the ring's {[m['name'] for m in st['ring']['members']]}")
    salt = 300
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for name in ("sum", "avg", "max"):
            if name == "avg" and not dtype.is_floating_point:
                continue
            for n in (1000, 300001):
                salt += 1
                t = data(RANK, n, dtype, salt)
                dist.all_reduce(t, op=OPS[name])
                want = expected(n, dtype, name, salt)
                if name == "avg":
                    want = want.to(dtype).to(torch.float64)
                check(close_to(t, want, dtype), f"{dtype} {name} n={n}: got {t[:4].tolist()}, want {want[:4].tolist()}")
    mine = [g for g in ringd.status()["groups"] if g["name"] == pg.ringd_group]
    check(len(mine) == 1 and set(mine[0]["hosts"]) == set(pg.ringd_hosts), f"the job's ringd group: {mine}")
    domains = [d for d in ringd.status()["domains"] if set(d["hosts"]) == set(pg.ringd_hosts)]
    check(len(domains) == 1 and domains[0]["ops_ring"] >= 5, f"the ring domain of the job's hosts: {domains}")
    # DDP over it: identical parameters on every rank after a few steps.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    train_checked(ddp, model, (32, 64), 5, "")


def train_checked(ddp, model, shape, steps, what):
    """A few SGD steps of `ddp` on this rank's own random inputs of `shape`; then the parameters
    must be identical on every rank (gathered through the default group)."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(RANK)
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(*shape, generator=g)).square().mean().backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    check(all(torch.equal(x, flat) for x in gathered), f"DDP parameters differ between ranks{what}")


def scenario_slots():
    """Ranks with different slots (RINGD_SLOT_BYTES 1 MiB on odd ranks, 2 MiB on even ones): a
    tensor bigger than a quarter of either slot is split the same way on every rank, through
    dist.all_reduce and through the comm hook (whose bucket fits the bigger slot's kept ranges,
    not the smaller one's); no op waits out ringd's op timeout."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    os.environ["RINGD_SLOT_BYTES"] = str((1 << 20) if RANK % 2 else (2 << 20))
    init()
    start = time.monotonic()
    for salt, n in ((500, 300001), (501, 70001), (502, 1 << 18)):  # 1.2 MB, 280 KB, exactly 1 MiB
        t = data(RANK, n, torch.float32, salt)
        dist.all_reduce(t)
        check(close_to(t, expected(n, torch.float32, "sum", salt), torch.float32), f"{n} floats, slots differ")
    torch.manual_seed(7)
    # 0.8 MB of gradients in one bucket: the comm hook keeps it in the 2 MiB slots (up to half of a
    # slot is kept), not in the 1 MiB ones, which take the copying path.
    layer = torch.nn.Linear(400, 500)
    h = DDP(layer, bucket_cap_mb=4)
    h.register_comm_hook(None, ringd.torch.allreduce_hook)
    train_checked(h, layer, (4, 400), 3, " with different slots")
    took = time.monotonic() - start
    check(took < OP_TIMEOUT_S, f"the ops took {took:.1f} s: some waited out ringd's op timeout")


def scenario_tensors():
    """Tensors and collectives beyond the plain allreduce: expanded (stride-0) tensors reduce the
    memory they refer to (and nothing around it); overlapping ones are refused alike on every
    rank; reduce_scatter, reduce_scatter_tensor and all_gather_into_tensor give exact values."""
    init()
    e = torch.tensor([float(RANK + 1)]).expand(6)
    dist.all_reduce(e)
    check(e.stride() == (0,) and bool((e == WORLD * (WORLD + 1) / 2).all()), f"an expanded tensor: {e.tolist()}")
    base = torch.arange(12, dtype=torch.float64).view(3, 4) + 100 * RANK
    col = base[:, 1:2].expand(3, 5)  # column 1, five times over
    dist.all_reduce(col, op=dist.ReduceOp.MAX)
    want = torch.arange(12, dtype=torch.float64).view(3, 4)
    want_col = want[:, 1] + 100 * (WORLD - 1)
    check(torch.equal(base[:, 1], want_col) and bool((col == want_col.view(3, 1)).all()), f"an expanded column: {base}")
    others = [0, 2, 3]
    check(torch.equal(base[:, others], want[:, others] + 100 * RANK), "elements beside an expanded column changed")
    try:
        dist.all_reduce(torch.arange(4.0).as_strided((3, 2), (1, 1)))
        fail("no error for overlapping elements")
    except RuntimeError as err:
        check("overlap" in str(err), f"error for overlapping elements: {err}")
    n = 1001
    everyone = [torch.stack([data(r, n, torch.float64, 600 + k) for k in range(WORLD)]) for r in range(WORLD)]
    total = sum(everyone)  # [k]: the sum of every rank's k-th input
    out = torch.empty(n, dtype=torch.float32)
    dist.reduce_scatter(out, [data(RANK, n, torch.float32, 600 + k) for k in range(WORLD)])
    check(torch.equal(out.to(torch.float64), total[RANK]), "reduce_scatter")
    out = torch.empty(n, dtype=torch.int64)
    dist.reduce_scatter_tensor(out, torch.cat([data(RANK, n, torch.int64, 600 + k) for k in range(WORLD)]),
                               op=dist.ReduceOp.MAX)
    check(torch.equal(out.to(torch.float64), torch.stack([x[RANK] for x in everyone]).max(0).values),
          "reduce_scatter_tensor MAX")
    mine = data(RANK, n, torch.float16, 700)
    out = torch.empty(WORLD * n, dtype=torch.float16)
    dist.all_gather_into_tensor(out, mine)
    check(torch.equal(out, torch.cat([data(r, n, torch.float16, 700) for r in range(WORLD)])),
          "all_gather_into_tensor")


def scenario_spawn():
    """torch.multiprocessing.spawn with init_method tcp:// and file:// (no MASTER_ADDR, no
    GLOO_SOCKET_IFNAME), as the PyTorch tutorials start a job on one host: the internal Gloo group
    finds its interface as init_process_group("gloo") does. Run by one process (RANK 0, WORLD 1)."""
    import tempfile
    import torch.multiprocessing as mp
    for name in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    port = int(os.environ.get("MASTER_PORT_BASE", "29500")) + 7
    with tempfile.TemporaryDirectory() as tmp:
        for method in (f"tcp://127.0.0.1:{port}", f"file://{tmp}/rendezvous"):
            mp.spawn(_spawned, args=(method,), nprocs=2, join=True)


def _spawned(rank, method):
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("ringd", init_method=method, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=1)  # through the internal Gloo group
    if not (bool((t == 3).all()) and bool((b == 1).all())):
        raise RuntimeError(f"{method}: allreduce {t[:3].tolist()}, broadcast {b.tolist()}")
    dist.destroy_process_group()


def scenario_contract():
    """torch 2's process-group contract (ringd/_compat.py), each item as torch 2.13 calls it."""
    import torch.distributed.distributed_c10d as c10d
    from torch._C._distributed_c10d import ProcessGroup
    init()
    pg = c10d._get_default_group()
    cls = type(pg)
    # Names: the group's, as FSDP2, DeviceMesh and functional collectives look it up.
    check(pg.group_name and pg.group_desc, f"the group's name {pg.group_name!r} and description {pg.group_desc!r}")
    sub = dist.new_group(list(range(WORLD)), group_desc="ringd-sub")
    check(sub.group_name != pg.group_name and sub.group_desc == "ringd-sub", f"a new group's name and description")
    # _get_backend(device): ringd's own answer (CPU tensors for FSDP2's buffers, from the slot).
    b = pg._get_backend(torch.device("cpu"))
    check(b.name() == "ringd" and not b.supports_splitting and b.supports_tensor_alloc(torch.device("cpu")) and
          not b.supports_tensor_alloc(torch.device("cuda")), f"_get_backend: {b}")
    # Exactly one name of each renamed pair: the one this torch's Python API calls.
    for new, old in (("all_gather_single", "_allgather_base"), ("reduce_scatter_single", "_reduce_scatter_base"),
                     ("all_to_all_single", "alltoall_base")):
        want = new if hasattr(ProcessGroup, new) else old
        defined = [n for n in (new, old) if n in cls.__dict__]
        check(defined == [want], f"ringd's group defines {defined} of the pair {new}/{old}, not [{want}]")
    # The group's timeout reached ringd (init's 60 s).
    mine = [g for g in ringd.status()["groups"] if g["name"] == pg.ringd_group]
    check(len(mine) == 1 and mine[0]["op_timeout_ms"] == 60000, f"the group's timeout in ringd: {mine}")
    # The coalescing manager, with a device (_start_coalescing / _end_coalescing: one Work) and
    # without (the coalesced collectives), allreduce, all_gather_into_tensor, reduce_scatter_tensor.
    before = ringd_ops_completed()
    for device in (torch.device("cpu"), None):
        ts = [data(RANK, 100 + 50 * k, torch.float32, 800 + k) for k in range(4)]
        with c10d._coalescing_manager(device=device, async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t)
        cm.wait()
        for k, t in enumerate(ts):
            check(close_to(t, expected(100 + 50 * k, torch.float32, "sum", 800 + k), torch.float32),
                  f"coalesced allreduce {k} (device {device})")
        outs = [torch.empty(WORLD * 30, dtype=torch.float64) for _ in range(3)]
        with c10d._coalescing_manager(device=device, async_ops=True) as cm:
            for k, o in enumerate(outs):
                dist.all_gather_into_tensor(o, data(RANK, 30, torch.float64, 810 + k))
        cm.wait()
        for k, o in enumerate(outs):
            check(torch.equal(o, torch.cat([data(r, 30, torch.float64, 810 + k) for r in range(WORLD)])),
                  f"coalesced all_gather_into_tensor {k} (device {device})")
        outs = [torch.empty(20, dtype=torch.float64) for _ in range(3)]
        with c10d._coalescing_manager(device=device, async_ops=True) as cm:
            for k, o in enumerate(outs):
                dist.reduce_scatter_tensor(o, data(RANK, 20 * WORLD, torch.float64, 820 + k))
        cm.wait()
        for k, o in enumerate(outs):
            want = sum(data(r, 20 * WORLD, torch.float64, 820 + k) for r in range(WORLD))[RANK * 20:(RANK + 1) * 20]
            check(torch.equal(o, want), f"coalesced reduce_scatter_tensor {k} (device {device})")
    ran = ringd_ops_completed() - before
    check(ran >= 14, f"{ran} ringd ops for the 8 coalesced allreduces and 6 reduce-scatters")
    # PREMUL_SUM (FSDP2 with a gradient divide factor): the sum of factor x each input, through ringd.
    if hasattr(dist.ReduceOp.PREMUL_SUM, "__call__"):
        before = ringd_ops_completed()
        t = data(RANK, 1000, torch.float32, 830)
        dist.all_reduce(t, op=dist.ReduceOp.PREMUL_SUM(0.25))
        check(close_to(t, expected(1000, torch.float32, "sum", 830) * 0.25, torch.float32), "PREMUL_SUM(0.25)")
        o = torch.empty(10, dtype=torch.float32)
        dist.reduce_scatter_tensor(o, data(RANK, 10 * WORLD, torch.float32, 831),
                                   op=dist.ReduceOp.PREMUL_SUM(torch.tensor(0.5)))
        want = sum(data(r, 10 * WORLD, torch.float64, 831) for r in range(WORLD))[RANK * 10:(RANK + 1) * 10] * 0.5
        check(close_to(o, want, torch.float32), "reduce_scatter_tensor PREMUL_SUM(tensor 0.5)")
        check(ringd_ops_completed() - before >= 2, "PREMUL_SUM went through ringd")
    # ringd's message as the error text, also through a chain of futures (reduce_scatter_tensor
    # runs an allreduce, then its callback), never torch's "Got the following error ..." wrapper.
    bad = dist.new_group(list(range(WORLD)))
    for k, op in enumerate((lambda: dist.all_reduce(torch.ones(300000 if RANK % 2 == 0 else 600000), group=bad),
                            lambda: dist.reduce_scatter_tensor(torch.empty(5), torch.ones(5 * WORLD), group=bad))):
        try:
            op()
            fail(f"no error from a group whose ranks' ops do not pair ({k})")
        except RuntimeError as e:
            check(str(e).startswith("ringd") and "Got the following error" not in str(e) and "\nAt:" not in str(e),
                  f"error {k} is not ringd's message alone: {e!r}")
    # shutdown (destroy_process_group of one group): its ringd group ends at once on this host,
    # while the Python object is still referenced.
    keep = dist.new_group(list(range(WORLD)))
    dist.all_reduce(torch.ones(4), group=keep)
    name = keep.ringd_group
    dist.destroy_process_group(keep)
    end = time.monotonic() + 3
    while any(g.get("name") == name for g in ringd.status().get("groups", [])):
        check(time.monotonic() < end, f"group {name} still in ringd 3 s after destroy_process_group (shutdown)")
        time.sleep(0.05)
    # abort: an op that cannot complete (only the even ranks submit it) fails at once with the
    # abort's reason; the odd ranks abort only after that (else ringd fails it first: a rank left).
    # The op takes the whole slot (8 MiB in 1 MiB ops through the 4 MiB slot): the ranges of its
    # ops still in ringd stay held until ringd surely ended them (the group's 4 s op timeout + the
    # 2 s wait margin), then the process's other groups have them again.
    margin = os.environ.get("RINGD_WAIT_MARGIN_MS")
    os.environ["RINGD_WAIT_MARGIN_MS"] = "2000"
    stuck = dist.new_group(list(range(WORLD)), timeout=datetime.timedelta(seconds=4))
    if RANK % 2 == 0:
        w = dist.all_reduce(torch.ones(2 << 20), group=stuck, async_op=True)
        time.sleep(0.3)
        start = time.monotonic()
        stuck.abort()
        try:
            w.wait()
            fail("an op of an aborted group completed")
        except RuntimeError as e:
            check("aborted" in str(e) and time.monotonic() - start < 2, f"after abort, {time.monotonic() - start:.1f} s: {e}")
        held = pg._engine.space.held_bytes()
        check(held >= 1 << 20, f"{held} bytes of the slot held after an abort with ops in ringd")
    dist.barrier()
    if RANK % 2:
        stuck.abort()
    if margin is None:
        del os.environ["RINGD_WAIT_MARGIN_MS"]
    else:
        os.environ["RINGD_WAIT_MARGIN_MS"] = margin
    t, start = torch.full((1 << 20,), float(RANK)), time.monotonic()  # (a MiB op: room only once they come back)
    dist.all_reduce(t)
    check(bool((t == sum(range(WORLD))).all()) and pg._engine.space.held_bytes() == 0 and time.monotonic() - start < 10,
          f"after the abort's ranges came back ({time.monotonic() - start:.1f} s, {pg._engine.space.held_bytes()} "
          f"bytes held): {t[:3].tolist()}")
    # DeviceMesh over ringd's group.
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (WORLD,))
    check(mesh.get_group().group_name == pg.group_name, "the mesh's group is the default group")
    t = torch.full((7,), float(RANK))
    dist.all_reduce(t, group=mesh.get_group())
    check(bool((t == sum(range(WORLD))).all()), "an allreduce over the mesh's group")


def _transformer():
    torch.manual_seed(4321)
    layers = [torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
              for _ in range(2)]
    return torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(32 * 6, 4))


def _batch(step, rank):
    g = torch.Generator().manual_seed(50000 + 100 * step + rank)
    return torch.randn(4, 6, 32, generator=g), torch.randn(4, 4, generator=g)


def _reference(steps, make_opt):
    """The same model and data in one process: the global batch (every rank's) each step."""
    m = _transformer()
    opt = make_opt(m.parameters())
    losses = []
    for step in range(steps):
        xs, ys = zip(*(_batch(step, r) for r in range(WORLD)))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(m(torch.cat(xs)), torch.cat(ys))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in m.parameters()]


def _train_sharded(m, opt, steps, what, copies=None, engines=()):
    """`copies`: a list that gets, per step, the bytes the `engines` copied into and out of the
    slot during the step's forward, backward and optimizer step."""
    losses = []
    counted = lambda: sum(e.copied_in + e.copied_out for e in engines)  # noqa: E731
    for step in range(steps):
        x, y = _batch(step, RANK)
        before = counted()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        if copies is not None:
            copies.append(counted() - before)
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)  # the global batch's loss (equal batches)
        losses.append(mean.item())
    return losses


def _compare(what, losses, ref_losses, params, ref_params):
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        check(abs(a - b) <= 1e-4 * max(abs(b), 1e-6), f"{what} step {step}: loss {a} vs one process's {b}")
    flat = torch.cat([p.reshape(-1) for p in params])
    ref = torch.cat([p.reshape(-1) for p in ref_params])
    check(torch.allclose(flat, ref, rtol=1e-4, atol=1e-5), f"{what}: parameters differ from one process's by "
          f"{(flat - ref).abs().max().item():.3g}")
    everyone = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(everyone, flat)
    for r, other in enumerate(everyone):
        check(torch.equal(other, flat), f"{what}: rank {r}'s full parameters differ from rank {RANK}'s")


def scenario_sharded():
    """Sharded training on ringd's groups, each against one process on the global batch: FSDP2
    (fully_shard over init_device_mesh), HSDP (a 2-D mesh: replicas x shards), and
    ZeroRedundancyOptimizer under DDP. Losses within 1e-4 relative, the full parameters identical
    on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    init()
    steps = 5
    sgd = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
    ref_losses, ref_params = _reference(steps, sgd)
    before = ringd_ops_completed()
    meshes = {"FSDP2": init_device_mesh("cpu", (WORLD,))}
    if WORLD % 2 == 0 and WORLD > 2:
        meshes["HSDP"] = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
    # FSDP2 once more with its collectives' buffers from the process group (over ringd's slot):
    # its all-gathers and reduce-scatters then run where the buffers lie, nothing copied.
    meshes["FSDP2 (buffers over the slot)"] = meshes["FSDP2"]
    for what, mesh in meshes.items():
        m = _transformer()
        for layer in list(m)[:2]:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        slot_buffers = "slot" in what
        if slot_buffers:  # (a setting of each fully_shard'ed module)
            for module in list(m)[:2] + [m]:
                module.set_allocate_memory_from_process_group_for_comm(True)
            engine = mesh.get_group()._engine
            in_place_before = engine.in_place_ops
        copies = []
        losses = _train_sharded(m, sgd(m.parameters()), steps, what, copies, [g._engine for g in mesh.get_all_groups()])
        _compare(what, losses, ref_losses, [p.full_tensor().detach() for p in m.parameters()], ref_params)
        if slot_buffers:
            # Nothing copied into or out of the slot in any step (the copying run's FSDP2 copies).
            check(all(c == 0 for c in copies), f"{what}: bytes copied into and out of the slot per step: {copies}")
        else:
            check(all(c > 0 for c in copies), f"{what}: no bytes counted as copied: {copies}")
        if slot_buffers:
            # Every step: 3 all-gathers forward, 3 reduce-scatters backward (2 layers, the root);
            # backward's all-gathers are reshards FSDP2 may skip.
            ran = engine.in_place_ops - in_place_before
            check(ran >= 6 * steps, f"{what}: {ran} of FSDP2's collectives ran on buffers over the slot, not >= {6 * steps}")
    check(ringd_ops_completed() - before >= steps * len(meshes), "the sharded gradients went through ringd")
    m = _transformer()
    ddp = torch.nn.parallel.DistributedDataParallel(m)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9)
    losses = _train_sharded(ddp, zero, steps, "ZeRO")
    _compare("ZeroRedundancyOptimizer", losses, ref_losses, [p.detach() for p in m.parameters()], ref_params)
    print(f"torch_ranks: rank {RANK}: losses one process {ref_losses[0]:.6f}..{ref_losses[-1]:.6f}, "
          f"{', '.join(meshes)} and ZeRO within 1e-4", flush=True)


def scenario_collectives():
    """reduce_scatter and allgather through ringd, the torch ranks numbered unlike the hosts'
    order (rank 0 stays where the store is; each host has ranks of both halves), each result
    checked here from every rank's inputs."""
    perm = [0] + [WORLD - r for r in range(1, WORLD)]  # this process's torch rank: 0, then reversed
    me = perm[RANK]
    os.environ["MASTER_PORT"] = str(int(os.environ.get("MASTER_PORT_BASE", "29500")))
    dist.init_process_group("ringd", rank=me, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    pg = dist.distributed_c10d._get_default_group()
    check(pg._engine.ranks == WORLD, "the ringd group does not run reduce_scatter and allgather through ringd")

    def mine(n, dtype, salt):
        return data(me, n, dtype, salt)

    before = ringd_ops_completed()
    salt, calls = 3000, 0
    for dtype in DTYPES:
        for name, op in list(OPS.items()) + [("premul", None)]:
            if name in ("avg", "premul") and not dtype.is_floating_point:
                continue
            for k in (1, 1000, 70001):
                salt += 1
                inp = mine(k * WORLD, dtype, salt)
                keep = inp.clone()
                want = expected(k * WORLD, dtype, "sum" if name == "premul" else name, salt)[me * k:(me + 1) * k]
                if name == "premul":
                    premul = getattr(dist.ReduceOp, "PREMUL_SUM", None)
                    rop = premul(0.5) if callable(premul) else None  # (torch 2 only)
                    if rop is None:
                        continue
                    want = want * 0.5
                else:
                    rop = op
                if name in ("avg", "premul"):
                    want = want.to(dtype).to(torch.float64)
                out = torch.empty(k, dtype=dtype)
                dist.reduce_scatter_tensor(out, inp, op=rop)
                check(close_to(out, want, dtype), f"reduce_scatter_tensor {dtype} {name} k={k}: got {out[:4].tolist()}, "
                                                  f"want {want[:4].tolist()}")
                check(torch.equal(inp, keep), f"reduce_scatter_tensor {dtype} {name} changed its input")
                calls += 1
                if k == 1000 and name != "premul":
                    # The list form, into a non-contiguous output (a column of a matrix).
                    ins = list(mine(k * WORLD, dtype, salt).view(WORLD, k).unbind(0))
                    host = torch.zeros(k, 3, dtype=dtype)
                    dist.reduce_scatter(host[:, 1], ins, op=op)
                    check(close_to(host[:, 1], want, dtype), f"reduce_scatter (list) {dtype} {name}")
                    check(bool((host[:, 0] == 0).all() and (host[:, 2] == 0).all()), "elements around an output changed")
                    calls += 1
        for k in (1, 1000, 70001):
            salt += 1
            inp = mine(k, dtype, salt)
            out = torch.empty(k * WORLD, dtype=dtype)
            dist.all_gather_into_tensor(out, inp)
            want = torch.cat([data(r, k, dtype, salt) for r in range(WORLD)])
            check(torch.equal(out, want), f"all_gather_into_tensor {dtype} k={k}")
            outs = [torch.full((k,), -1, dtype=dtype) for _ in range(WORLD)]
            dist.all_gather(outs, inp)
            check(all(torch.equal(o, data(r, k, dtype, salt)) for r, o in enumerate(outs)), f"all_gather (list) {dtype} k={k}")
            check(torch.equal(inp, mine(k, dtype, salt)), f"all_gather changed its input ({dtype})")
            calls += 2
    ran = ringd_ops_completed() - before
    check(ran >= calls, f"ringd completed {ran} ops for {calls} reduce_scatters and allgathers: some went elsewhere")
    # Their copies into and out of the slot are counted, and ringd's status has them (this host's
    # ranks' together).
    eng = pg._engine
    copied = ringd.status()["copies"]
    check(0 < eng.copied_in <= copied["in_bytes"] and 0 < eng.copied_out <= copied["out_bytes"],
          f"copies counted: this rank {eng.copied_in} in, {eng.copied_out} out; ringd's status {copied}")
    # Buffers over the slot (FSDP2's allocate_tensor, through the backend on torch 2): an allgather
    # in place, a reduce_scatter apart and an allreduce on them run where they lie, nothing copied;
    # rank 1's allgather output is ordinary memory (a rank whose slot had no room to lend): its
    # ringd ops pair with the others' all the same.
    eng, cpu = pg._engine, torch.device("cpu")
    backend = pg._get_backend(cpu) if hasattr(pg, "_get_backend") else None  # (torch 2's contract)
    if backend is not None:
        check(backend.supports_tensor_alloc(cpu), "the ringd backend does not allocate CPU tensors")
        alloc = lambda n, dt: backend.allocate_tensor(n, dtype=dt, device=cpu)  # noqa: E731
    else:
        alloc = lambda n, dt: pg._allocate_tensor(n, dt, cpu)  # noqa: E731
    in_place_before, lent_before = eng.in_place_ops, eng.lent
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for k in (1, 5000):
            salt += 1
            out = alloc(k * WORLD, dtype) if me != 1 else torch.empty(k * WORLD, dtype=dtype)
            inp = out[me * k:(me + 1) * k]
            inp.copy_(mine(k, dtype, salt))
            dist.all_gather_into_tensor(out, inp)
            check(torch.equal(out, torch.cat([data(r, k, dtype, salt) for r in range(WORLD)])),
                  f"all_gather_into_tensor in place over the slot {dtype} k={k}")
            rs_in, rs_out = alloc(k * WORLD, dtype), alloc(k, dtype)
            rs_in.copy_(mine(k * WORLD, dtype, salt))
            dist.reduce_scatter_tensor(rs_out, rs_in)
            check(close_to(rs_out, expected(k * WORLD, dtype, "sum", salt)[me * k:(me + 1) * k], dtype),
                  f"reduce_scatter_tensor over the slot {dtype} k={k}")
            ar = alloc(k, dtype)
            ar.copy_(mine(k, dtype, salt))
            dist.all_reduce(ar)
            check(close_to(ar, expected(k, dtype, "sum", salt), dtype), f"all_reduce over the slot {dtype} k={k}")
            del out, inp, rs_in, rs_out, ar
    per_rank = 6 * (3 if me != 1 else 2)
    check(eng.in_place_ops - in_place_before == per_rank,
          f"{eng.in_place_ops - in_place_before} ops ran where their tensors lie, not {per_rank}")
    lent = 6 * (4 if me != 1 else 3)
    check(eng.lent - lent_before == lent, f"{eng.lent - lent_before} tensors lent over the slot, not {lent}")
    # Freed, they are the slot's again (taken back at the next allocation, once the engine's
    # threads let go of the last op).
    import gc
    until = time.monotonic() + 5
    while True:
        gc.collect()
        alloc(1, torch.float32)
        if eng.ps.space.lent_bytes <= 64 or time.monotonic() > until:
            break
        time.sleep(0.02)
    check(eng.ps.space.lent_bytes <= 64, f"{eng.ps.space.lent_bytes} bytes still lent after the tensors were freed")
    # Empty tensors: nothing to move, the ranks still meet.
    dist.all_gather_into_tensor(torch.empty(0), torch.empty(0))
    dist.reduce_scatter_tensor(torch.empty(0), torch.empty(0))
    # An allreduce between them, and one after.
    t = torch.full((10,), float(me))
    dist.all_reduce(t)
    check(bool((t == WORLD * (WORLD - 1) / 2).all()), "an allreduce after the collectives")
    print(f"torch_ranks: rank {RANK}: {calls} reduce_scatters and allgathers through ringd ({ran} ringd ops)", flush=True)


def scenario_rooted():
    """broadcast, reduce and barrier through ringd, ranks numbered unlike the hosts' order: every
    dtype x op, the root on every rank, one-shot sizes and chained ones (several ringd ops per
    tensor), a non-contiguous tensor; each result checked here from every rank's inputs, a
    reduce's non-root tensors and a broadcast's root tensor unchanged; a barrier that waits for a
    late rank."""
    perm = [0] + [WORLD - r for r in range(1, WORLD)]
    me = perm[RANK]
    os.environ["MASTER_PORT"] = str(int(os.environ.get("MASTER_PORT_BASE", "29500")))
    dist.init_process_group("ringd", rank=me, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    pg = dist.distributed_c10d._get_default_group()
    check(pg._rooted, "the ringd group does not run broadcast, reduce and barrier through ringd")
    before = ringd_ops_completed()
    salt, calls, root = 5000, 0, 0
    premul = getattr(dist.ReduceOp, "PREMUL_SUM", None)
    for dtype in DTYPES:
        ops = list(OPS.items()) + ([("premul", None)] if callable(premul) else [])
        for name, op in ops + [("broadcast", None)]:
            if name in ("avg", "premul") and not dtype.is_floating_point:
                continue
            for k in (1, 1000, 150001):
                salt += 1
                root = (root + 1) % WORLD
                t = data(me, k, dtype, salt)
                if name == "broadcast":
                    dist.broadcast(t, src=root)
                    check(torch.equal(t, data(root, k, dtype, salt)), f"broadcast {dtype} k={k} from {root}")
                else:
                    want = expected(k, dtype, "sum" if name == "premul" else name, salt)
                    rop = premul(0.5) if name == "premul" else op
                    if name == "premul":
                        want = want * 0.5
                    if name in ("avg", "premul"):
                        want = want.to(dtype).to(torch.float64)
                    dist.reduce(t, dst=root, op=rop)
                    if me == root:
                        check(close_to(t, want, dtype), f"reduce {dtype} {name} k={k} to {root}: got {t[:4].tolist()}, "
                                                        f"want {want[:4].tolist()}")
                    else:
                        check(torch.equal(t, data(me, k, dtype, salt)), f"reduce {dtype} {name} changed rank {me}'s tensor")
                calls += 1
    ran = ringd_ops_completed() - before
    check(ran >= calls, f"ringd completed {ran} ops for {calls} broadcasts and reduces: some went elsewhere")
    # PRODUCT (not ringd's op): Gloo's, and the group goes on.
    t = torch.full((3,), 2.0)
    dist.reduce(t, dst=0, op=dist.ReduceOp.PRODUCT)
    check(me != 0 or bool((t == 2.0 ** WORLD).all()), f"reduce PRODUCT: {t.tolist()}")
    # A column of a matrix (not contiguous): only its elements change.
    salt += 1
    host = torch.zeros(1000, 3)
    host[:, 1] = data(me, 1000, torch.float32, salt)
    dist.broadcast(host[:, 1], src=WORLD - 1)
    check(torch.equal(host[:, 1], data(WORLD - 1, 1000, torch.float32, salt)), "broadcast into a column")
    check(bool((host[:, 0] == 0).all() and (host[:, 2] == 0).all()), "elements around a broadcast column changed")
    # A barrier waits for the last rank to reach it.
    dist.barrier()
    if me == WORLD - 1:
        time.sleep(0.5)
    start = time.monotonic()
    dist.barrier()
    waited = time.monotonic() - start
    check(me == WORLD - 1 or waited >= 0.4, f"rank {me} left the barrier after {waited:.3f} s, before the late rank came")
    # An async broadcast, then an allreduce after them all.
    t = torch.full((10,), float(me))
    dist.broadcast(t, src=1, async_op=True).wait()
    check(bool((t == 1).all()), "an async broadcast")
    dist.all_reduce(t)
    check(bool((t == WORLD).all()), "an allreduce after the broadcasts")
    print(f"torch_ranks: rank {RANK}: {calls} broadcasts and reduces through ringd ({ran} ringd ops)", flush=True)


def scenario_a2a():
    """all_to_all_single (uneven split sizes with zeros, and equal blocks) and the list form through
    ringd, ranks numbered unlike the hosts' order, every dtype; each result checked here from every
    rank's inputs, inputs unchanged."""
    perm = [0] + [WORLD - r for r in range(1, WORLD)]
    me = perm[RANK]
    os.environ["MASTER_PORT"] = str(int(os.environ.get("MASTER_PORT_BASE", "29500")))
    dist.init_process_group("ringd", rank=me, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    pg = dist.distributed_c10d._get_default_group()
    check(pg._rooted, "the ringd group does not run all_to_all through ringd")
    # Every rank is this release's: the group cuts tensors with a shrinking end (and all_to_alls of
    # equal blocks into parts); the cut is a function of the count alone, the same on every rank.
    from ringd._slot import _chunks
    check(pg._engine.taper, "a group of this release's ranks does not taper")
    mib = (1 << 20) // 4
    got = list(_chunks(64 * mib, 4, 64 << 20))
    check(got == [4 * mib, 8 * mib, 16 * mib, 16 * mib, 16 * mib, 4 * mib], f"64 MiB cut into {got}")
    got = list(_chunks(64 * mib, 4, 64 << 20, taper=False))
    check(got == [4 * mib, 8 * mib, 16 * mib, 32 * mib, 4 * mib], f"64 MiB cut without the taper into {got}")
    for count in (1, 1000, 3 * mib + 7, 25 * mib, 100 * mib + 3):
        got = list(_chunks(count, 4, 16 << 20))
        check(sum(got) == count and all(0 < c <= 16 * mib for c in got) and (len(got) == 1 or got[-1] <= 4 * mib),
              f"{count} elements cut into {got}")

    def split(i, j, k, salt):  # rank i sends rank j this many elements
        return (i * 31 + j * 17 + salt) % 4 * k + (i + j) % 2

    before = ringd_ops_completed()
    salt, calls = 7000, 0
    for dtype in DTYPES:
        for k in (1, 3000):
            salt += 1
            ins = [split(me, j, k, salt) for j in range(WORLD)]
            outs = [split(i, me, k, salt) for i in range(WORLD)]
            inp = data(me, sum(ins), dtype, salt)
            keep = inp.clone()
            out = torch.full((sum(outs),), -7, dtype=dtype)
            dist.all_to_all_single(out, inp, output_split_sizes=outs, input_split_sizes=ins)
            want = torch.cat([data(i, sum(split(i, j, k, salt) for j in range(WORLD)), dtype, salt)
                              [sum(split(i, j, k, salt) for j in range(me)):][:outs[i]] for i in range(WORLD)])
            check(torch.equal(out, want), f"all_to_all_single {dtype} k={k}: got {out[:6].tolist()}, want {want[:6].tolist()}")
            check(torch.equal(inp, keep), f"all_to_all_single {dtype} changed its input")
            # Equal blocks, and the list form.
            inp = data(me, k * WORLD, dtype, salt)
            out = torch.empty(k * WORLD, dtype=dtype)
            dist.all_to_all_single(out, inp)
            want = torch.cat([data(i, k * WORLD, dtype, salt)[me * k:(me + 1) * k] for i in range(WORLD)])
            check(torch.equal(out, want), f"all_to_all_single (equal blocks) {dtype} k={k}")
            outl = [torch.empty(outs[i], dtype=dtype) for i in range(WORLD)]
            inl = list(data(me, sum(ins), dtype, salt).split(ins))
            dist.all_to_all(outl, inl)
            want = [data(i, sum(split(i, j, k, salt) for j in range(WORLD)), dtype, salt)
                    [sum(split(i, j, k, salt) for j in range(me)):][:outs[i]] for i in range(WORLD)]
            check(all(torch.equal(o, w) for o, w in zip(outl, want)), f"all_to_all (list) {dtype} k={k}")
            calls += 3
    # Equal blocks too large for one ringd op's first part: several ops, each the same part of
    # every block, copied out into the output's blocks (a column of its [ranks, k] view).
    salt += 1
    k = (5 << 20) // (4 * WORLD) + 13
    inp = data(me, k * WORLD, torch.float32, salt)
    out = torch.full((k * WORLD,), -7.0)
    first = ringd_ops_completed()
    dist.all_to_all_single(out, inp)
    want = torch.cat([data(i, k * WORLD, torch.float32, salt)[me * k:(me + 1) * k] for i in range(WORLD)])
    check(torch.equal(out, want), f"all_to_all_single (equal blocks of {k}, in parts)")
    check(ringd_ops_completed() - first >= 2, f"an all_to_all of {4 * k * WORLD} bytes went as one ringd op")
    # Split sizes all equal on one rank (a mixture-of-experts rank whose experts are all at
    # capacity) and uneven on the others, more than an all_to_all's first part: one op on every
    # rank (a rank that cut its equal ones into parts as for equal blocks left the group's ops
    # out of step).
    k2 = (1536 << 10) // (4 * WORLD)  # (1.5 MiB: several parts of a quarter of the test's 4 MiB slots)

    def uneven(i, j):
        return k2 if 0 in (i, j) else k2 + (i * 7 + j * 3) % 5 * 1000
    ins = [uneven(me, j) for j in range(WORLD)]
    outs = [uneven(i, me) for i in range(WORLD)]
    inp = data(me, sum(ins), torch.float32, salt)
    out = torch.full((sum(outs),), -7.0)
    dist.all_to_all_single(out, inp, outs, ins)
    want = torch.cat([data(i, sum(uneven(i, j) for j in range(WORLD)), torch.float32, salt)
                      [sum(uneven(i, j) for j in range(me)):][:outs[i]] for i in range(WORLD)])
    check(torch.equal(out, want), f"all_to_all_single (split sizes of {k2} on rank 0, uneven on the others)")
    calls += 2
    # Mixture-of-experts' shape: [tokens, hidden] split by rows; then input split sizes only (the
    # output in equal blocks).
    salt += 1
    hidden = 3
    ins = [split(me, j, 5, salt) for j in range(WORLD)]
    outs = [split(i, me, 5, salt) for i in range(WORLD)]
    inp = data(me, sum(ins) * hidden, torch.float32, salt).view(-1, hidden)
    out = torch.empty(sum(outs), hidden)
    dist.all_to_all_single(out, inp, output_split_sizes=outs, input_split_sizes=ins)
    want = torch.cat([data(i, sum(split(i, j, 5, salt) for j in range(WORLD)) * hidden, torch.float32, salt).view(-1, hidden)
                      [sum(split(i, j, 5, salt) for j in range(me)):][:outs[i]] for i in range(WORLD)])
    check(torch.equal(out, want), "all_to_all_single of [tokens, hidden] by row split sizes")
    inp = data(me, 4 * WORLD, torch.float32, salt)
    out = torch.empty(4 * WORLD)
    dist.all_to_all_single(out, inp, output_split_sizes=[4] * WORLD)
    want = torch.cat([data(i, 4 * WORLD, torch.float32, salt)[me * 4:(me + 1) * 4] for i in range(WORLD)])
    check(torch.equal(out, want), "all_to_all_single with the output's split sizes only")
    calls += 2
    ran = ringd_ops_completed() - before
    check(ran >= calls, f"ringd completed {ran} ops for {calls} all_to_alls: some went elsewhere")
    t = torch.full((WORLD,), float(me))
    o = torch.empty(WORLD)
    dist.all_to_all_single(o, t, async_op=True).wait()
    check(torch.equal(o, torch.arange(WORLD, dtype=torch.float32)), "an async all_to_all_single")
    print(f"torch_ranks: rank {RANK}: {calls} all_to_alls through ringd ({ran} ringd ops)", flush=True)


def scenario_wire():
    """Compressed wires (docs/wire.md): a group's wire for its float32 sums (within the documented
    bound of the f64 sum, not exact, the same on every rank), a max under it exact, and DDP with
    ringd.torch.compressed_hook (int8 with error feedback, bf16) training as Gloo does."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    init()
    gloo = dist.new_group(backend="gloo")
    hosts = WORLD // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    n = 300_001  # (past tuning.direct_max_bytes: the ring)

    def grads(rank):
        g = torch.Generator().manual_seed(77 + rank)
        scale = torch.pow(2.0, torch.randint(-8, 5, ((n + 255) // 256,), generator=g).float()).repeat_interleave(256)[:n]
        return torch.randn(n, generator=g) * scale

    xs = [grads(r) for r in range(WORLD)]
    exact = torch.stack([x.double() for x in xs]).sum(0)
    mags = torch.stack([x.double().abs() for x in xs]).sum(0)
    blockmax = sum(torch.nn.functional.max_pool1d(x.double().abs().view(1, 1, -1), 511, stride=1, padding=255).view(-1)
                   for x in xs)
    for wire, unit in (("bf16", 2.0 ** -8), ("fp16", 2.0 ** -11), ("int8", (1 + 2.0 ** -14) / 254)):
        ringd.torch.set_wire(None, wire)
        t = xs[RANK].clone()
        dist.all_reduce(t)
        err = (t.double() - exact).abs()
        bound = hosts * unit * (blockmax if wire == "int8" else mags) + (hosts + WORLD + 2) * 2.0 ** -24 * mags
        check(bool((err <= bound).all()), f"{wire}: {int((err > bound).sum())} values past the bound "
                                          f"(largest error {err.max().item():.3g})")
        check(err.max().item() > 1e-5 * exact.abs().max().item(), f"{wire}: the sum is exact: did it go compressed?")
        everyone = [torch.empty_like(t) for _ in range(WORLD)]
        dist.all_gather(everyone, t, group=gloo)
        check(all(torch.equal(e, t) for e in everyone), f"{wire}: ranks' results differ")
    t = xs[RANK].clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # (the group's int8 leaves a max exact)
    check(torch.equal(t.double(), torch.stack([x.double() for x in xs]).max(0).values), "a max under an int8 wire")
    ringd.torch.set_wire(None, "exact")

    def big():
        torch.manual_seed(99)
        return torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(),
                                   torch.nn.Linear(256, 4))
    ref = train(DDP(big(), process_group=gloo, bucket_cap_mb=1), steps=12)
    for wire in ("int8", "bf16"):
        m = DDP(big(), bucket_cap_mb=1)
        m.register_comm_hook(None, ringd.torch.compressed_hook(wire))
        losses = train(m, steps=12)
        check(abs(losses[-1] - ref[-1]) <= 0.02 * abs(ref[-1]), f"{wire} hook: last loss {losses[-1]} vs gloo's {ref[-1]}")
        flat = torch.cat([p.detach().view(-1) for p in m.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(WORLD)]
        dist.all_gather(everyone, flat, group=gloo)
        check(all(torch.equal(e, flat) for e in everyone), f"{wire} hook: ranks' parameters differ")
        print(f"torch_ranks: rank {RANK}: {wire} hook: last loss {losses[-1]:.6f}, gloo's {ref[-1]:.6f}", flush=True)
    check(ringd.status()["ring"]["wire"]["feedback_tags"] >= 1, "int8 hook: no error-feedback residual in ringd")


SCENARIOS = {"wire": scenario_wire, "rooted": scenario_rooted, "a2a": scenario_a2a, "collectives": scenario_collectives, "contract": scenario_contract, "sharded": scenario_sharded, "ops": scenario_ops, "slots": scenario_slots, "tensors": scenario_tensors, "spawn": scenario_spawn, "refused": scenario_refused, "async": scenario_async, "ddp": scenario_ddp, "die": scenario_die,
             "restart": scenario_restart, "groups": scenario_groups, "part": scenario_part}

if __name__ == "__main__":
    names = sys.argv[1].split("+") if len(sys.argv) == 2 else []
    if not names or any(n not in SCENARIOS for n in names):
        sys.exit(f"usage: torch_ranks.py SCENARIO[+SCENARIO...] ({'|'.join(SCENARIOS)})")
    # Every wait has a deadline: a hung rank prints where it hangs and fails.
    faulthandler.dump_traceback_later(float(os.environ.get("TORCH_RANKS_DEADLINE_S", "240")), exit=True)
    base = int(os.environ.get("MASTER_PORT_BASE", "29500"))
    # Several scenarios in one process (one torch import): each on a store of its own port.
    for k, name in enumerate(names):
        os.environ["MASTER_PORT_BASE"] = str(base + 10 * k)
        SCENARIOS[name]()
        if dist.is_initialized():
            dist.destroy_process_group()
        # Every process group is gone, and with it every tensor the scenario had over ringd's
        # slot (lent to FSDP, the comm hook's results): the slot is unmapped, so a process that
        # makes and destroys groups in turn does not keep each one's slot.
        gc.collect()
        with open("/proc/self/maps") as maps:
            left = sorted({line.split()[-2] for line in maps if "/memfd:ringd-" in line})
        check(not left, f"{name}: ringd's slot still mapped after destroy_process_group: {left}")
        print(f"torch_ranks: rank {RANK}: {name} ok", flush=True)
