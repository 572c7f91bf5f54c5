# PyTorch per-op timings for the convolutions and BatchNorms of ResNet-18 for CIFAR at WIDTH,
# the peer of `tandem bench conv`: forward, and forward + backward of sum(y * r) (input gradient
# for every layer but the stem, whose input is data; weight gradient always), median ms.
# usage: python torch_conv_ops.py BATCH WIDTH REPEATS THREADS
import sys, time
import torch, torch.nn.functional as F

b, w, repeats, threads = (int(a) for a in sys.argv[1:5])
torch.set_num_threads(threads)


def shapes():
    # (name, cin, cout, kernel, stride, side)
    yield ("stem 3x3", 3, w, 3, 1, 32)
    for stage, (cin, cout, side) in enumerate([(w, w, 32), (w, 2 * w, 32), (2 * w, 4 * w, 16), (4 * w, 8 * w, 8)]):
        stride = 1 if stage == 0 else 2
        yield (f"layer{stage + 1} 3x3 s{stride}", cin, cout, 3, stride, side)
        if stride == 2:
            yield (f"layer{stage + 1} 3x3 s1", cout, cout, 3, 1, side // 2)
            yield (f"layer{stage + 1} 1x1 s2", cin, cout, 1, 2, side)


def median_ms(f):
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter(); f(); times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


g = torch.Generator().manual_seed(0)
for name, cin, cout, k, s, side in shapes():
    x = torch.randn(b, cin, side, side, generator=g).requires_grad_(name != "stem 3x3")
    wt = (torch.randn(cout, cin, k, k, generator=g) * 0.1).requires_grad_()
    y = F.conv2d(x, wt, stride=s, padding=k // 2)
    r = torch.randn(y.shape, generator=g)
    fwd = median_ms(lambda: F.conv2d(x, wt, stride=s, padding=k // 2))
    def step():
        x.grad = None; wt.grad = None
        (F.conv2d(x, wt, stride=s, padding=k // 2) * r).sum().backward()
    print(f"op=conv2d name={name.replace(' ', '_')} fwd_ms={fwd:.4f} fwdbwd_ms={median_ms(step):.4f}")
for c, side in [(w, 32), (2 * w, 16), (4 * w, 8), (8 * w, 4)]:
    bn = torch.nn.BatchNorm2d(c).train()
    x = torch.randn(b, c, side, side, generator=g).requires_grad_()
    r = torch.randn(x.shape, generator=g)
    fwd = median_ms(lambda: bn(x))
    def step():
        x.grad = None; bn.zero_grad()
        (bn(x) * r).sum().backward()
    print(f"op=batch_norm name=bn_{c}x{side}x{side} fwd_ms={fwd:.4f} fwdbwd_ms={median_ms(step):.4f}")
