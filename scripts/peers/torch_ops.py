# PyTorch per-op timings, the peer of `tandem bench ops`: reads the op list (JSON, from tandem)
# on stdin and times each op as tandem does — forward, and forward + backward of sum(y * r)
# less that harness's own cost (the input gradient only where the op's input_grad says so;
# parameters' always); for
# ungrouped convolutions also forward + each backward alone (data: the input's gradient, the
# weight frozen; filter: the weight's, the input detached); an optimizer's row is one step() —
# median ms. Inputs are filled by tandem's formula (`filled` in
# crates/tandem-bench/src/ops/timing.rs),
# so each op's forward output sum (an optimizer's parameter sum after one step) is printed for
# tandem to compare with its own. Prints one `RESULT {json}` line per op: name, fwd_ms,
# fwdbwd_ms, data_ms and filter_ms (convolutions), sum, abs_sum.
# Ops: conv2d (c_in -> c_out, kernel, stride, padding, groups), batch_norm (training mode),
# patch_embed (arcface_torch's ViT PatchEmbed: a c_in -> c_out convolution, kernel = stride,
# with bias, on data), prelu (one slope per channel), linear (rows x c_in -> c_out, bias),
# linear_relu6 (the ViT's fc1 and its ReLU6), layer_norm over rows x c_in, attention
# (arcface_torch's ViT Attention between its qkv and proj linears), sgd and adamw over
# parameters of the listed sizes.
# usage: python torch_ops.py BATCH REPEATS THREADS [DEVICE [DTYPE]] < ops.json
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


def filled(shape, salt, scale, grad=False):
    """tandem's inputs: ((i * 7919 + salt) mod 2003) / 2003 - 0.5, times scale, in f32."""
    n = 1
    for d in shape:
        n *= d
    i = torch.arange(n, dtype=torch.int64)
    v = (((i * 7919 + salt) % 2003).to(torch.float32) / 2003.0 - 0.5) * scale
    return v.reshape(shape).to(device, dtype).requires_grad_(grad)


def harness_ms(r):
    """What sum(y * r) and its backward cost alone (a leaf of y's shape): subtracted from every
    forward + backward time, as tandem does on its side."""
    leaf = r.detach().clone().requires_grad_()

    def run():
        leaf.grad = None
        (leaf * r).sum().backward()

    return median_ms(run)


def checksum(t):
    t = t.detach().double()
    return {"sum": t.sum().item(), "abs_sum": t.abs().sum().item()}


def report(row):
    """One op's figures as the `RESULT {json}` line tandem reads."""
    print("RESULT " + json.dumps(row), flush=True)


def attention(qkv, heads):
    n, t, three_d = qkv.shape
    d = three_d // 3
    q, k, v = qkv.reshape(n, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
    a = ((q @ k.transpose(-2, -1)) * (d // heads) ** -0.5).softmax(dim=-1)
    return (a @ v).transpose(1, 2).reshape(n, t, d)


def optimizer_row(op):
    params = [filled([n], 10 + i, 0.2).requires_grad_() for i, n in enumerate(op["numels"])]
    for i, (p, n) in enumerate(zip(params, op["numels"])):
        p.grad = filled([n], 1000 + i, 0.02)
    if op["kind"] == "sgd":
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)
    else:
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    opt.step()
    total = sum(p.detach().double().sum().item() for p in params)
    mags = sum(p.detach().double().abs().sum().item() for p in params)
    ms = median_ms(opt.step)
    return {"fwd_ms": ms, "fwdbwd_ms": ms, "sum": total, "abs_sum": mags}


for op in ops:
    kind, grad = op["kind"], op["input_grad"]
    rows = op["rows"] or b
    c_in, c_out, side = op["c_in"], op["c_out"], op["side"]
    if kind in ("sgd", "adamw"):
        report({"name": op["name"], **optimizer_row(op)})
        continue
    params = []
    if kind == "conv2d":
        k, s, pad, groups = op["kernel"], op["stride"], op["padding"], op["groups"]
        x = filled([b, c_in, side, side], 1, 2.0, grad)
        wt = filled([c_out, c_in // groups, k, k], 2, 0.2, True)
        params = [wt]
        f = lambda: F.conv2d(x, wt, stride=s, padding=pad, groups=groups)
    elif kind == "patch_embed":
        k = op["kernel"]
        x = filled([b, c_in, side, side], 1, 2.0)
        wt = filled([c_out, c_in, k, k], 2, 0.2, True)
        bias = filled([c_out], 3, 0.2, True)
        params = [wt, bias]
        f = lambda: F.conv2d(x, wt, bias, stride=op["stride"])
    elif kind == "batch_norm":
        x = filled([b, c_in, side, side], 1, 2.0, grad)
        m = torch.nn.BatchNorm2d(c_in).train().to(device)
        params = list(m.parameters())
        f = lambda: m(x)
    elif kind == "prelu":
        x = filled([b, c_in, side, side], 1, 2.0, grad)
        m = torch.nn.PReLU(c_in, init=0.25).to(device)
        params = list(m.parameters())
        f = lambda: m(x) if dtype == torch.float32 else F.prelu(x, m.weight.to(dtype))
    elif kind in ("linear", "linear_relu6"):
        x = filled([rows, c_in], 1, 2.0, grad)
        wt = filled([c_out, c_in], 2, 0.2, True)
        bias = filled([c_out], 3, 0.2, True) if op["bias"] else None
        params = [wt] + ([bias] if bias is not None else [])
        if kind == "linear":
            f = lambda: F.linear(x, wt, bias)
        else:
            f = lambda: F.relu6(F.linear(x, wt, bias))
    elif kind == "layer_norm":
        x = filled([rows, c_in], 1, 2.0, grad)
        wt = (filled([c_in], 2, 0.2) + 1.0).detach().requires_grad_()
        bias = filled([c_in], 3, 0.2, True)
        params = [wt, bias]
        f = lambda: F.layer_norm(x, (c_in,), wt, bias, 1e-5)
    elif kind == "attention":
        x = filled([b, op["tokens"], 3 * c_in], 1, 2.0, grad)
        f = lambda: attention(x, op["heads"])
    else:
        sys.exit(f"op {op['name']}: unknown kind {kind}")
    y = f()
    r = filled(list(y.shape), 5, 2.0)

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        (f() * r).sum().backward()

    fwd, harness = median_ms(f), harness_ms(r)
    less = lambda t: max(t - harness, fwd)
    row = {"name": op["name"], "fwd_ms": fwd, "fwdbwd_ms": less(median_ms(step))}
    if kind == "conv2d" and groups == 1:
        x_fixed, w_fixed = x.detach(), wt.detach()

        def data():
            x.grad = None
            (F.conv2d(x, w_fixed, stride=s, padding=pad) * r).sum().backward()

        def filt():
            wt.grad = None
            (F.conv2d(x_fixed, wt, stride=s, padding=pad) * r).sum().backward()

        if grad:
            row["data_ms"] = less(median_ms(data))
        row["filter_ms"] = less(median_ms(filt))
    report({**row, **checksum(y)})
