"""PyTorch's gloo running the program `tests/torch_collectives.rs` runs in tandem: the
collectives past the core on the same inputs. Writes OUT/n{N}_rank{R}.json per rank: a map from
step name to what that rank holds after the step (lists of numbers, or the objects).

usage: torch_collectives.py OUT N [N ...]
"""
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def val(r, i):
    # Small integers: float sums are exact in any order.
    return float((r * 7 + i * 3) % 11 - 5)


def count(frm, to):
    return (2 * frm + to) % 4


def value(frm, to, i):
    return frm * 1000 + to * 100 + i


def program(r, n):
    out = {}
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)

    x = f32([val(r, i) for i in range(10)])
    dist.reduce(x, dst=1, op=dist.ReduceOp.SUM)
    if r == 1:
        out["reduce_sum_f32"] = x.tolist()
    x = i64([(r * 5 + i) % 9 - 4 for i in range(7)])
    dist.reduce(x, dst=0, op=dist.ReduceOp.MAX)
    if r == 0:
        out["reduce_max_i64"] = x.tolist()
    x = i32([(r + i) % 3 + 1 for i in range(6)])
    dist.reduce(x, dst=n - 1, op=dist.ReduceOp.PRODUCT)
    if r == n - 1:
        out["reduce_product_i32"] = x.tolist()
    for name, op in [("band", dist.ReduceOp.BAND), ("bor", dist.ReduceOp.BOR), ("bxor", dist.ReduceOp.BXOR)]:
        x = i64([(r * 37 + i * 11) % 64 for i in range(9)])
        dist.reduce(x, dst=0, op=op)
        if r == 0:
            out[f"reduce_{name}_i64"] = x.tolist()
        y = i32([(r * 13 + i * 5) % 32 for i in range(9)])
        dist.all_reduce(y, op=op)
        out[f"all_reduce_{name}_i32"] = y.tolist()
    x = f32([val(r, i) * 4 for i in range(5)])
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    out["all_reduce_avg_f32"] = x.tolist()

    x = f32([val(r, i) for i in range(2 * n)])
    y = torch.zeros(2 * n, dtype=torch.float32)
    dist.all_to_all_single(y, x)
    out["all_to_all_single_even_f32"] = y.tolist()
    ins = [count(r, t) for t in range(n)]
    outs = [count(f, r) for f in range(n)]
    x = i64([value(r, t, i) for t in range(n) for i in range(count(r, t))])
    y = torch.full((sum(outs),), -1, dtype=torch.int64)
    dist.all_to_all_single(y, x, output_split_sizes=outs, input_split_sizes=ins)
    out["all_to_all_single_uneven_i64"] = y.tolist()
    # gloo's list form takes equal blocks only (tandem's takes any: collectives_more.rs).
    xs = [torch.tensor([value(r, t, i) / 8 for i in range(2)], dtype=torch.float64) for t in range(n)]
    ys = [torch.zeros(2, dtype=torch.float64) for f in range(n)]
    dist.all_to_all(ys, xs)
    out["all_to_all_list_f64"] = [y.tolist() for y in ys]

    ys = [torch.zeros(3) for _ in range(n)]
    dist.all_gather(ys, f32([val(r, i) for i in range(3)]))
    out["all_gather_list_f32"] = [y.tolist() for y in ys]
    x = f32([val(r, i) for i in range(4)])
    g = [torch.zeros(4) for _ in range(n)] if r == 0 else None
    dist.gather(x, gather_list=g, dst=0)
    if r == 0:
        out["gather_f32"] = [t.tolist() for t in g]
    y = torch.zeros(3, dtype=torch.int64)
    src = 1 % n
    dist.scatter(y, scatter_list=[i64([q * 10 + i for i in range(3)]) for q in range(n)] if r == src else None, src=src)
    out["scatter_i64"] = y.tolist()
    y = torch.zeros(2)
    dist.reduce_scatter(y, [f32([val(r, q + i) for i in range(2)]) for q in range(n)])
    out["reduce_scatter_f32"] = y.tolist()

    # P2P: a ring shift in one batch, then three messages in order from rank 0 to rank 1.
    to, frm = (r + 1) % n, (r - 1) % n
    recv = torch.zeros(5)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, f32([r * 10 + i for i in range(5)]), to),
                                   dist.P2POp(dist.irecv, recv, frm)])
    for q in reqs:
        q.wait()
    out["p2p_ring_f32"] = recv.tolist()
    if r == 0:
        reqs = [dist.isend(i64([k] * (k + 2)), 1) for k in range(3)]
        for q in reqs:
            q.wait()
    elif r == 1:
        bufs = [torch.zeros(k + 2, dtype=torch.int64) for k in range(3)]
        reqs = [dist.irecv(b, 0) for b in bufs]
        for q in reqs:
            q.wait()
        out["p2p_order_i64"] = [b.tolist() for b in bufs]

    note = {"rank": r, "name": f"rank-{r}", "loss": r / 8}
    objs = [None] * n
    dist.all_gather_object(objs, note)
    out["all_gather_object"] = objs
    got = [None] * n if r == 0 else None
    dist.gather_object(note, got, dst=0)
    if r == 0:
        out["gather_object"] = got
    lst = ["from", n - 1, {"k": [1, 2]}] if r == n - 1 else [None, None, None]
    dist.broadcast_object_list(lst, src=n - 1)
    out["broadcast_object_list"] = lst
    mine = [None]
    dist.scatter_object_list(mine, [{"to": q, "w": [q] * q} for q in range(n)] if r == 0 else None, src=0)
    out["scatter_object_list"] = mine[0]
    return out


def run(r, n, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=n)
    result = program(r, n)
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"n{n}_rank{r}.json"), "w") as f:
        json.dump(result, f)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


if __name__ == "__main__":
    out_dir = sys.argv[1]
    for n in map(int, sys.argv[2:]):
        mp.spawn(run, args=(n, free_port(), out_dir), nprocs=n)
    print("OK", torch.__version__)
