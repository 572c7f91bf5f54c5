# PyTorch FSDP2's side of `tandem bench fsdp`: arcface_torch's ViT (torch_face_recipe.py's,
# the one the face benchmarks train) under `fully_shard` per block then the root, gloo ranks on
# loopback, AdamW, synthetic 112x112 images, the mean square of the embedding as the loss.
# Prints `RESULT {"rank": R, "peak_rss": BYTES, "step_secs": S}` (JSON) for every rank.
# usage: python torch_fsdp_vit.py --model vit_l --nproc 2 --steps 3 --batch 2
import argparse, importlib.util, json, os, resource, socket, statistics, sys, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("torch_face_recipe", os.path.join(HERE, "torch_face_recipe.py"))
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)


def worker(rank, args, port, q):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc)
    dim, depth, drop_path, mask = recipe.VIT[args.model]
    model = recipe.VisionTransformer(dim, depth, 8, 512, mask, drop_path)
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, 3, 112, 112)
    times = []
    for i in range(args.steps + 1):
        t = time.perf_counter()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i > 0:
            times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows = [None] * args.nproc
    dist.all_gather_object(rows, (rank, peak, statistics.median(times)))
    if rank == 0:
        q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="vit_l")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, port, q)) for r in range(args.nproc)]
    for pr in procs:
        pr.start()
    rows = q.get(timeout=3600)
    for pr in procs:
        pr.join(120)
        if pr.exitcode != 0:
            sys.exit(f"a rank exited with {pr.exitcode}")
    for rank, peak, secs in rows:
        print("RESULT " + json.dumps({"rank": rank, "peak_rss": peak, "step_secs": secs}))


if __name__ == "__main__":
    main()
