# PyTorch counterpart of `cargo run --release -p tandem-ddp --example step_probe -- BATCH`: one
# plain training step of the bench MLP split into forward+loss, backward and optimizer time.
# usage: python scripts/torch_step_probe.py BATCH [THREADS]
import torch, torch.nn as nn, time, sys
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv)>2 else 1)
bs=int(sys.argv[1])
torch.manual_seed(0)
m=nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
opt=torch.optim.SGD(m.parameters(), lr=0.01)
x=torch.randn(bs,784); y=torch.randint(0,10,(bs,)); lf=nn.CrossEntropyLoss()
tf=tb=to=0
n=30
for i in range(n+3):
    t0=time.perf_counter(); opt.zero_grad(); l=lf(m(x),y); t1=time.perf_counter(); l.backward(); t2=time.perf_counter(); opt.step(); t3=time.perf_counter()
    if i>=3: tf+=t1-t0; tb+=t2-t1; to+=t3-t2
ms=lambda t: t/n*1e3
print(f"torch batch {bs}: forward {ms(tf):.2f} backward {ms(tb):.2f} opt {ms(to):.2f} total {ms(tf+tb+to):.2f} ({bs*n/(tf+tb+to):.0f} samples/s)")
