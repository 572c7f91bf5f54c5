# PyTorch gloo on the collectives `tandem bench allreduce` measures, the same way: each rank's
# input of SIZE bytes (f32), a warm-up on the largest size first, then per collective and size
# the median time over enough iterations for SECONDS, the slowest rank's.
# usage: python torch_collectives_bench.py WORLD OPS SIZES SECONDS WARMUP_SECONDS
#   OPS: comma-separated all_reduce, reduce_scatter, all_to_all; SIZES: bytes, K/M/G suffixes
# prints: RESULT {"op": OP, "bytes": BYTES, "secs": SECONDS} (JSON), a line per collective and size
import json, socket, statistics, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def buffers(op, nbytes, n):
    elems = max(nbytes // 4, 1)
    if op != "all_reduce":
        elems = max(elems // n, 1) * n
    inp = torch.ones(elems)
    out = {"reduce_scatter": torch.zeros(elems // n), "all_to_all": torch.zeros(elems)}.get(op)
    return inp, out


def run(op, inp, out):
    if op == "all_reduce":
        dist.all_reduce(inp)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(out, inp)
    else:
        dist.all_to_all_single(out, inp)


def iterations(nbytes, seconds):
    per = max(nbytes / 1e9, 20e-6)
    return min(max(int(seconds / per), 5), 5000)


def worker(rank, world, ops, sizes, seconds, warmup, port, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    largest = max(sizes)
    for op in ops:
        run(op, *buffers(op, largest, world))
    inp, out = buffers(ops[0], largest, world)
    until = time.perf_counter() + warmup
    while True:
        run(ops[0], inp, out)
        done = torch.tensor([1.0 if time.perf_counter() >= until else 0.0])
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        if done.item() > 0:
            break
    for op in ops:
        for nbytes in sizes:
            inp, out = buffers(op, nbytes, world)
            nbytes = inp.numel() * 4  # the size measured (split collectives round to the ranks)
            for _ in range(3):
                run(op, inp, out)
            dist.barrier()
            times = []
            for _ in range(iterations(nbytes, seconds)):
                t = time.perf_counter()
                run(op, inp, out)
                times.append(time.perf_counter() - t)
            med = torch.tensor([statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
            if rank == 0:
                q.put((op, nbytes, med.item()))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        q.put(None)


if __name__ == "__main__":
    world, ops = int(sys.argv[1]), sys.argv[2].split(",")
    sizes = [parse_size(s) for s in sys.argv[3].split(",")]
    seconds, warmup = float(sys.argv[4]), float(sys.argv[5])
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, world, ops, sizes, seconds, warmup, port, q)) for r in range(world)]
    [p.start() for p in ps]
    # Bounded: a rank that dies leaves the queue empty, and the parent reports it.
    while (item := q.get(timeout=600)) is not None:
        print("RESULT " + json.dumps({"op": item[0], "bytes": item[1], "secs": item[2]}), flush=True)
    [p.join() for p in ps]
    if any(p.exitcode != 0 for p in ps):
        sys.exit(1)
