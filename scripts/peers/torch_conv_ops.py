# PyTorch per-op timings, the peer of `tandem bench conv`: reads the op list (JSON, from tandem)
# on stdin and times each op as tandem does — forward, and forward + backward of sum(y * r)
# (the input gradient only where the op's input_grad says so; the weight's always); for
# convolutions also forward + each backward alone (data: the input's gradient, the weight
# frozen; filter: the weight's, the input detached) — median ms.
# Ops: conv2d (c_in -> c_out, kernel, stride, padding kernel // 2), batch_norm (training mode),
# prelu (one slope per channel).
# usage: python torch_conv_ops.py BATCH REPEATS THREADS [DEVICE [DTYPE]] < ops.json
# DEVICE cpu (default) or cuda (cudnn.benchmark on, TF32 at PyTorch's defaults, a synchronize
# after every timed call); DTYPE f32 (default), f16 or bf16 (activations and conv weights;
# BatchNorm and PReLU keep f32 parameters, as under torch.autocast).
import json, sys, time
import torch, torch.nn.functional as F

b, repeats, threads = (int(a) for a in sys.argv[1:4])
device = torch.device(sys.argv[4] if len(sys.argv) > 4 else "cpu")
dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[
    sys.argv[5] if len(sys.argv) > 5 else "f32"]
torch.set_num_threads(threads)
if device.type == "cuda":
    torch.backends.cudnn.benchmark = True
ops = json.load(sys.stdin)


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(f):
    f()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter(); f(); sync(); times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


g = torch.Generator().manual_seed(0)
for op in ops:
    c_in, c_out, side = op["c_in"], op["c_out"], op["side"]
    x = torch.randn(b, c_in, side, side, generator=g).to(device, dtype).requires_grad_(op["input_grad"])
    if op["kind"] == "conv2d":
        k, s = op["kernel"], op["stride"]
        wt = (torch.randn(c_out, c_in, k, k, generator=g) * 0.1).to(device, dtype).requires_grad_()
        params = [wt]
        f = lambda: F.conv2d(x, wt, stride=s, padding=k // 2)
    elif op["kind"] == "batch_norm":
        m = torch.nn.BatchNorm2d(c_in).train().to(device)
        params = list(m.parameters())
        f = lambda: m(x)
    else:
        m = torch.nn.PReLU(c_in, init=0.25).to(device)
        params = list(m.parameters())
        f = lambda: m(x) if dtype == torch.float32 else F.prelu(x, m.weight.to(dtype))
    r = torch.randn(f().shape, generator=g).to(device, dtype)

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        (f() * r).sum().backward()

    fwd = median_ms(f)
    line = f"op={op['kind']} name={op['name']} fwd_ms={fwd:.4f} fwdbwd_ms={median_ms(step):.4f}"
    if op["kind"] == "conv2d":
        x_fixed, w_fixed = x.detach(), wt.detach()

        def data():
            x.grad = None
            (F.conv2d(x, w_fixed, stride=s, padding=k // 2) * r).sum().backward()

        def filt():
            wt.grad = None
            (F.conv2d(x_fixed, wt, stride=s, padding=k // 2) * r).sum().backward()

        if op["input_grad"]:
            line += f" data_ms={median_ms(data):.4f}"
        line += f" filter_ms={median_ms(filt):.4f}"
    print(line, flush=True)
