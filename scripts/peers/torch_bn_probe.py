# PyTorch's training BatchNorm2d (+ReLU) at CIFAR ResNet-18's shapes (width 16, batch 64), the
# peer of `cargo run --release -p tandem-nn --example bn_probe`: best-of-N ms forward and backward.
import sys, time, torch, torch.nn.functional as F
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 20
def best(f):
    f(); ts = []
    for _ in range(repeats):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return min(ts) * 1e3
for n, c, side in [(64, 16, 32), (64, 32, 16), (64, 64, 8), (64, 128, 4)]:
    x = torch.randn(n, c, side, side, requires_grad=True)
    bn = torch.nn.BatchNorm2d(c); gy = torch.randn(n, c, side, side)
    for relu in (False, True):
        fwd_f = (lambda: F.relu(bn(x))) if relu else (lambda: bn(x))
        fwd = best(fwd_f)
        def step():
            y = fwd_f(); y.backward(gy); x.grad = None; bn.weight.grad = None; bn.bias.grad = None
        print(f"bn{'+relu' if relu else ''} [{n}, {c}, {side}, {side}]: forward {fwd:.3f} ms, backward {best(step) - fwd:.3f} ms")
