"""PyTorch's side of crates/tandem-cli/tests/face_recipe.rs and of `tandem bench face`: insightface arcface_torch's
training recipe (train_v2.py: IResNet under DDP with broadcast_buffers=False and 16 MB buckets,
PartialFC v2 over all-gathered embeddings, CombinedMarginLoss, SGD over two parameter groups,
clip_grad_norm_(backbone, 5), PolyScheduler stepped every iteration, DistributedSampler +
DataLoader(drop_last=True)), written here from its description over gloo on the CPU.

usage:
  (every mode: --network NAME picks arcface_torch's r18 .. r200, mbf, mbf_large or a vit_* over --depth)
  python reference.py init OUT.pt --classes C --width W --embedding E [--seed S] [--depth 18]
      [--no-head]
      Writes {"backbone": IResNet state dict, "partial_fc": {"weight": [C, E]}}: torch's
      default init of the layers, arcface_torch's N(0, 0.01) centres (--no-head: the backbone
      only; `train` then draws each rank's centres from the seed).
  python reference.py train --data DIR --init INIT.pt --world 2 --width W --embedding E
      --margin M1,M2,M3 --scale S --batch B --epochs N --lr LR --momentum 0.9 --wd 5e-4
      --warmup K --clip 5 --seed S [--out MODEL.pt] [--threads T] [--depth 18] [--gradient-acc N]
      [--classes C --sample-rate R]
      --sample-rate below 1 runs PartialFC v2's class sampling (positives kept, the rest by the
      top-k of random scores, the sampled rows indexed out of the shard). Also prints rank 0's
      `step_ms data=.. forward=.. head=.. backward=.. optimizer=..` and every rank's
      `peak_rss_bytes=a,b,...` (ru_maxrss). On a GPU (--device cuda): cudnn.benchmark, and
      [--amp f16|bf16] runs arcface_torch's fp16 (torch.autocast over the backbone's body and the
      logits, a GradScaler with growth_interval 100 for f16); --warmup-steps K leaves the first K
      steps out of samples/s; --profile waits for the GPU at each phase so step_ms splits the
      time (without it only the total is timed, the host running ahead as in training); prints
      `gpu_peak_bytes=` (torch.cuda.max_memory_allocated).
  python reference.py verify MODEL.pt --pairs PAIRS.bin --width W --embedding E [--depth 18]
      insightface's verification test of a backbone state dict on a `.bin` pair set (eval mode,
      each image plus its mirror, L2-normalised, 10-fold threshold in 0..4 by 0.01); prints
      `accuracy=X std=Y`.
      Trains, rank 0 writes the backbone's state dict (arcface_torch's model.pt) to --out, and
      prints `samples/s=X` (every step's samples over all ranks, timed from the first epoch's
      start, data loading included, as `tandem train` times its steps).

The PartialFC functions (gather with a gradient summed times the world size, the distributed
cross-entropy, the combined margin) are those of tandem-partial-fc's fixtures.
"""
import argparse
import io
import json
import os
import socket
import struct
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "crates", "tandem-partial-fc", "tests", "fixtures"))
from make_fixtures import DistCrossEntropy, GatherSumTimesWorld, combined_margin  # noqa: E402

BLOCKS = {18: [2, 2, 2, 2], 34: [3, 4, 6, 3], 50: [3, 4, 14, 3], 100: [3, 13, 30, 3], 200: [6, 26, 60, 6]}


def conv3x3(cin, cout, stride=1):
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin, eps=1e-5)
        self.conv1 = conv3x3(cin, cout)
        self.bn2 = nn.BatchNorm2d(cout, eps=1e-5)
        self.prelu = nn.PReLU(cout)
        self.conv2 = conv3x3(cout, cout, stride)
        self.bn3 = nn.BatchNorm2d(cout, eps=1e-5)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(cout, eps=1e-5))

    def forward(self, x):
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        return out + (self.downsample(x) if self.downsample is not None else x)


class IResNet(nn.Module):
    """arcface_torch's IResNet layout and names, stage widths w, 2w, 4w, 8w."""

    def __init__(self, depth, width, embedding):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width, eps=1e-5)
        self.prelu = nn.PReLU(width)
        cin = width
        for i, (n, mult) in enumerate(zip(BLOCKS[depth], [1, 2, 4, 8])):
            blocks = [Block(cin, width * mult, 2)] + [Block(width * mult, width * mult, 1) for _ in range(n - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            cin = width * mult
        self.bn2 = nn.BatchNorm2d(cin, eps=1e-5)
        self.dropout = nn.Dropout(p=0.0)
        self.fc = nn.Linear(cin * 7 * 7, embedding)
        self.features = nn.BatchNorm1d(embedding, eps=1e-5)
        nn.init.constant_(self.features.weight, 1.0)
        self.features.weight.requires_grad = False

    # arcface_torch's `fp16`: the body under torch.autocast, fc and features in float32.
    amp_dtype = None

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=self.amp_dtype or torch.float32,
                            enabled=self.amp_dtype is not None):
            x = self.prelu(self.bn1(self.conv1(x)))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            x = self.dropout(torch.flatten(self.bn2(x), 1))
        return self.features(self.fc(x.float() if self.amp_dtype is not None else x))


class ConvBn(nn.Module):
    """arcface_torch's ConvBlock (conv, BatchNorm, PReLU) or, without `prelu`, LinearBlock."""

    def __init__(self, cin, cout, kernel=1, stride=1, padding=0, groups=1, prelu=True):
        super().__init__()
        mods = [nn.Conv2d(cin, cout, kernel, stride, padding, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        if prelu:
            mods.append(nn.PReLU(cout))
        self.layers = nn.Sequential(*mods)

    def forward(self, x):
        return self.layers(x)


class DepthWise(nn.Module):
    """1x1 expand to `inner`, 3x3 depthwise (its stride), 1x1 project, plus x when residual."""

    def __init__(self, cin, cout, inner, stride, residual):
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(ConvBn(cin, inner), ConvBn(inner, inner, 3, stride, 1, groups=inner),
                                    ConvBn(inner, cout, prelu=False))

    def forward(self, x):
        y = self.layers(x)
        return y + x if self.residual else y


class Residual(nn.Module):
    def __init__(self, c, n, inner):
        super().__init__()
        self.layers = nn.Sequential(*[DepthWise(c, c, inner, 1, True) for _ in range(n)])

    def forward(self, x):
        return self.layers(x)


class Gdc(nn.Module):
    """The global depthwise 7x7 LinearBlock, flatten, Linear without bias, BatchNorm1d."""

    def __init__(self, embedding):
        super().__init__()
        self.layers = nn.Sequential(ConvBn(512, 512, 7, groups=512, prelu=False), nn.Flatten(),
                                    nn.Linear(512, embedding, bias=False), nn.BatchNorm1d(embedding))

    def forward(self, x):
        return self.layers(x)


MBF = {"mbf": ((1, 4, 6, 2), 2), "mbf_large": ((2, 8, 12, 4), 4)}


class MobileFaceNet(nn.Module):
    """arcface_torch's MobileFaceNet layout and names (backbones/mobilefacenet.py), `blocks` per
    residual stage and channel `scale` (mbf: (1, 4, 6, 2) x2, mbf_large: (2, 8, 12, 4) x4)."""

    def __init__(self, blocks, scale, embedding):
        super().__init__()
        c1, c2 = 64 * scale, 128 * scale
        self.layers = nn.ModuleList([ConvBn(3, c1, 3, 2, 1)])
        self.layers.append(ConvBn(c1, c1, 3, 1, 1, groups=64) if blocks[0] == 1 else Residual(c1, blocks[0], 128))
        self.layers.extend([DepthWise(c1, c1, 128, 2, False), Residual(c1, blocks[1], 128),
                            DepthWise(c1, c2, 256, 2, False), Residual(c2, blocks[2], 256),
                            DepthWise(c2, c2, 512, 2, False), Residual(c2, blocks[3], 256)])
        self.conv_sep = ConvBn(c2, 512)
        self.features = Gdc(embedding)
        for m in self.modules():  # arcface_torch's _initialize_weights
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    amp_dtype = None

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=self.amp_dtype or torch.float32,
                            enabled=self.amp_dtype is not None):
            for f in self.layers:
                x = f(x)
        return self.features(self.conv_sep(x.float() if self.amp_dtype is not None else x))


class VitMlp(nn.Module):

    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.ReLU6()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class VitAttention(nn.Module):

    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))


class DropPath(nn.Module):
    """timm's DropPath: each sample's branch kept with probability 1 - p, scaled by 1 / (1 - p)."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if self.p == 0 or not self.training:
            return x
        keep = 1 - self.p
        return x * x.new_empty((x.shape[0], 1, 1)).bernoulli_(keep).div_(keep)


class VitBlock(nn.Module):

    def __init__(self, dim, num_heads, drop_path=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.attn = VitAttention(dim, num_heads)
        self.drop_path = DropPath(drop_path)
        self.mlp = VitMlp(dim, dim * 4)

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class VitPatchEmbed(nn.Module):

    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=9, stride=9)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class VisionTransformer(nn.Module):
    """arcface_torch's ViT (patch 9 on 112x112, 144 patches) at width `dim`; `noise`, when set,
    stands in for torch.rand(N, L) in random_masking (the tests' fixtures)."""

    def __init__(self, dim, depth, num_heads, num_classes, mask_ratio, drop_path_rate=0.0):
        super().__init__()
        self.patch_embed = VitPatchEmbed(dim)
        self.num_patches, self.embed_dim, self.mask_ratio = 144, dim, mask_ratio
        self.pos_embed = nn.Parameter(torch.zeros(1, 144, dim))
        rates = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.ModuleList([VitBlock(dim, num_heads, r) for r in rates])
        self.norm = nn.LayerNorm(dim)
        self.feature = nn.Sequential(
            nn.Linear(dim * 144, dim, bias=False), nn.BatchNorm1d(dim, eps=2e-5),
            nn.Linear(dim, num_classes, bias=False), nn.BatchNorm1d(num_classes, eps=2e-5))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.noise = None

    def random_masking(self, x, mask_ratio=0.1):
        n, l, d = x.size()
        len_keep = int(l * (1 - mask_ratio))
        noise = torch.rand(n, l, device=x.device) if self.noise is None else self.noise.to(x.dtype)
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :len_keep]
        x_masked = torch.gather(x, dim=1, index=ids_keep.unsqueeze(-1).repeat(1, 1, d))
        return x_masked, None, ids_restore

    def forward(self, x):
        b = x.shape[0]
        x = self.patch_embed(x) + self.pos_embed
        if self.training and self.mask_ratio > 0:
            x, _, ids_restore = self.random_masking(x)
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        if self.training and self.mask_ratio > 0:
            tokens = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] - x.shape[1], 1)
            x = torch.cat([x, tokens], dim=1)
            x = torch.gather(x, dim=1, index=ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))
        return self.feature(torch.reshape(x, (b, 144 * self.embed_dim)))


# get_model(name)'s ViTs: (width, depth, drop_path_rate, mask_ratio); 8 heads each.
VIT = {"vit_t": (256, 12, 0.1, 0.1), "vit_s": (512, 12, 0.1, 0.1), "vit_b": (512, 24, 0.1, 0.1),
       "vit_l": (768, 24, 0.05, 0.05), "vit_l_dp005_mask_005": (768, 24, 0.05, 0.05),
       "vit_t_dp005_mask0": (256, 12, 0.05, 0.0), "vit_s_dp005_mask_0": (512, 12, 0.05, 0.0),
       "vit_b_dp005_mask_005": (512, 24, 0.05, 0.05), "vit_h": (1024, 48, 0.1, 0.0)}


def make_backbone(args):
    """--network (arcface_torch's r18 .. r200, mbf, mbf_large, vit_*, or iresnetN) over --depth."""
    name = args.network or f"iresnet{args.depth}"
    if name in MBF:
        return MobileFaceNet(*MBF[name], args.embedding)
    if name in VIT:
        dim, depth, drop_path, mask = VIT[name]
        return VisionTransformer(dim, depth, 8, args.embedding, mask, drop_path)
    depth = int(name.removeprefix("iresnet").removeprefix("r"))
    return IResNet(depth, args.width, args.embedding)


class PolyScheduler(torch.optim.lr_scheduler._LRScheduler):
    """insightface's PolyScheduler (power 2, linear warm-up from 0)."""

    def __init__(self, optimizer, base_lr, max_steps, warmup_steps, last_epoch=-1):
        self.base_lr = base_lr
        self.warmup_lr_init = 0.0001
        self.max_steps = max_steps
        self.warmup_steps = warmup_steps
        self.power = 2
        super().__init__(optimizer, -1)
        self.last_epoch = last_epoch

    def get_lr(self):
        if self.last_epoch == -1:
            return [self.warmup_lr_init for _ in self.optimizer.param_groups]
        if self.last_epoch < self.warmup_steps:
            alpha = float(self.last_epoch) / float(self.warmup_steps)
            return [self.base_lr * alpha for _ in self.optimizer.param_groups]
        alpha = pow(1 - float(self.last_epoch - self.warmup_steps)
                    / float(self.max_steps - self.warmup_steps), self.power)
        return [self.base_lr * alpha for _ in self.optimizer.param_groups]


class RecFaces(torch.utils.data.Dataset):
    """An insightface RecordIO folder (train.rec + train.idx), as its MXFaceDataset reads it."""

    def __init__(self, root):
        self.rec = open(os.path.join(root, "train.rec"), "rb").read()
        self.offsets = {}
        for line in open(os.path.join(root, "train.idx")):
            k, off = line.split("\t")
            self.offsets[int(k)] = int(off)
        flag, labels, _ = self.header(0) if 0 in self.offsets else (0, [], b"")
        if flag > 0:
            self.keys = list(range(1, int(labels[0])))
        else:
            self.keys = sorted(self.offsets)

    def record(self, key):
        off = self.offsets[key]
        magic, lrec = struct.unpack("<II", self.rec[off:off + 8])
        assert magic == 0xCED7230A and lrec >> 29 == 0, (key, hex(magic), lrec >> 29)
        return self.rec[off + 8:off + 8 + (lrec & ((1 << 29) - 1))]

    def header(self, key):
        r = self.record(key)
        flag, label, _, _ = struct.unpack("<IfQQ", r[:24])
        if flag > 0:
            labels = struct.unpack(f"<{flag}f", r[24:24 + 4 * flag])
            return flag, list(labels), r[24 + 4 * flag:]
        return flag, [label], r[24:]

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        _, labels, img = self.header(self.keys[i])
        rgb = np.asarray(Image.open(io.BytesIO(img)).convert("RGB"), dtype=np.float32)
        x = (torch.from_numpy(rgb).permute(2, 0, 1) / 255.0 - 0.5) / 0.5
        return x, torch.tensor(int(labels[0]), dtype=torch.long)


class PartialFC(nn.Module):
    """PartialFC v2: this rank's centres, cosine logits, margin, distributed CE. At sample_rate
    < 1 each step keeps the positive classes and fills up to int(sample_rate * num_local) rows
    by the top-k of random scores (positives scored 2.0), the sampled rows indexed out of the
    shard (arcface_torch's `sample`). `full_weight` None: this rank's rows N(0, 0.01) from the
    seed (a head too large to write out)."""

    def __init__(self, full_weight, margin, world, rank, classes=None, embedding=None,
                 sample_rate=1.0, seed=0, dtype=torch.float32):
        super().__init__()
        c = full_weight.shape[0] if full_weight is not None else classes
        self.num_local = c // world + int(rank < c % world)
        self.start = c // world * rank + min(rank, c % world)
        if full_weight is None:
            g = torch.Generator().manual_seed(seed * 1000 + rank)
            rows = torch.normal(0, 0.01, (self.num_local, embedding), generator=g, dtype=dtype)
        else:
            rows = full_weight[self.start:self.start + self.num_local].clone()
        self.weight = nn.Parameter(rows)
        self.margin = margin
        self.sample_rate = sample_rate
        self.num_sample = int(sample_rate * self.num_local)
        self.amp_dtype = None

    def forward(self, embeddings, labels):
        gathered = GatherSumTimesWorld.apply(embeddings)
        parts = [torch.zeros_like(labels) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, labels)
        labels = torch.cat(parts).view(-1, 1)
        mine = (self.start <= labels) & (labels < self.start + self.num_local)
        labels = torch.where(mine, labels - self.start, torch.full_like(labels, -1))
        weight = self.weight
        if self.sample_rate < 1:
            positive = torch.unique(labels[labels >= 0], sorted=True)
            if self.num_sample - positive.size(0) >= 0:
                perm = torch.rand(size=[self.num_local], device=labels.device)
                perm[positive] = 2.0
                index = torch.topk(perm, k=self.num_sample)[1].sort()[0]
            else:
                index = positive
            hit = labels >= 0
            labels[hit] = torch.searchsorted(index, labels[hit])
            weight = self.weight[index]
        # arcface_torch's PartialFC_V2: the cosine logits under autocast, then float32.
        with torch.autocast(embeddings.device.type, dtype=self.amp_dtype or torch.float32,
                            enabled=self.amp_dtype is not None):
            logits = F.linear(F.normalize(gathered), F.normalize(weight))
        logits = logits.float().clamp(-1, 1)
        logits = combined_margin(logits, labels, *self.margin)
        return DistCrossEntropy.apply(logits, labels)


def init(args):
    torch.manual_seed(args.seed)
    net = make_backbone(args)
    if args.no_head:
        # A head too large to write out: each side draws its own N(0, 0.01) centres.
        torch.save({"backbone": net.state_dict()}, args.out)
        return
    weight = torch.normal(0, 0.01, (args.classes, args.embedding))
    torch.save({"backbone": net.state_dict(), "partial_fc": {"weight": weight}}, args.out)


def verify(args):
    import pickle
    net = make_backbone(args)
    net.load_state_dict(torch.load(args.out, weights_only=True), strict=True)
    net.eval()
    with open(args.pairs, "rb") as f:
        images, issame = pickle.load(f, encoding="bytes")
    def load(b):
        rgb = np.asarray(Image.open(io.BytesIO(bytes(b))).convert("RGB"), dtype=np.float32)
        return (torch.from_numpy(rgb).permute(2, 0, 1) / 255.0 - 0.5) / 0.5
    x = torch.stack([load(b) for b in images])
    with torch.no_grad():
        emb = (net(x) + net(torch.flip(x, dims=[3]))).numpy().astype(np.float64)
    emb /= np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    dist = ((emb[0::2] - emb[1::2]) ** 2).sum(1)
    same = np.asarray(issame, dtype=bool)
    n, folds, thresholds = len(same), 10, np.arange(0, 4, 0.01)
    accs, start = [], 0
    for f in range(folds):
        size = n // folds + (1 if f < n % folds else 0)
        test = np.arange(start, start + size)
        train = np.setdiff1d(np.arange(n), test)
        start += size
        acc = lambda th, idx: np.mean((dist[idx] < th) == same[idx])
        best = max(range(len(thresholds)), key=lambda t: (acc(thresholds[t], train), -t))
        accs.append(acc(thresholds[best], test))
    print(f"accuracy={np.mean(accs):.6f} std={np.std(accs):.6f}")


def worker(rank, args, port):
    torch.set_num_threads(args.threads)
    if args.double:
        torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev.index or 0)
        # arcface_torch's train_v2.py: cuDNN picks each convolution's fastest algorithm.
        torch.backends.cudnn.benchmark = True
    amp = {"none": None, "f16": torch.float16, "bf16": torch.bfloat16}[args.amp]

    def clock(phase=False):
        # With --profile, phases are timed on the host after waiting for the GPU's queued work;
        # otherwise only the run's end waits (the host runs ahead of the GPU, as in training).
        if cuda and (args.profile or not phase):
            torch.cuda.synchronize()
        return time.perf_counter()
    m1, m2, m3 = (float(v) for v in args.margin.split(","))
    saved = torch.load(args.init, weights_only=True)
    backbone = make_backbone(args)
    backbone.load_state_dict(saved["backbone"], strict=True)
    dtype = torch.get_default_dtype()
    backbone.to(dtype).to(dev)
    backbone.amp_dtype = amp
    backbone = nn.parallel.DistributedDataParallel(backbone, broadcast_buffers=False, bucket_cap_mb=16)
    backbone.train()
    full = saved["partial_fc"]["weight"].to(dtype) if "partial_fc" in saved else None
    head = PartialFC(full, (args.scale, m1, m2, m3, 0.0), args.world, rank, classes=args.classes,
                     embedding=args.embedding, sample_rate=args.sample_rate, seed=args.seed, dtype=dtype)
    head.to(dev)
    head.amp_dtype = amp
    # arcface_torch: torch.cuda.amp.GradScaler(growth_interval=100) with fp16 (bf16 needs none).
    scaler = torch.amp.GradScaler(dev.type, growth_interval=100) if amp == torch.float16 else None
    opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": head.parameters()}],
                          lr=args.lr, momentum=args.momentum, weight_decay=args.wd)
    data = RecFaces(args.data)
    sampler = torch.utils.data.distributed.DistributedSampler(
        data, num_replicas=args.world, rank=rank, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True,
                                         num_workers=args.workers, persistent_workers=args.workers > 0)
    total = len(loader) * args.epochs
    sched = PolyScheduler(opt, args.lr, total, args.warmup)
    step, samples = 0, 0
    # Where rank 0's step time goes, as `tandem train` splits it (seconds summed).
    times = {"data": 0.0, "forward": 0.0, "head": 0.0, "backward": 0.0, "optimizer": 0.0}
    started = time.perf_counter()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        waited = time.perf_counter()
        for img, labels in loader:
            if args.steps and step >= args.steps:
                break
            step += 1
            if args.warmup_steps and step == args.warmup_steps + 1:
                # One-off costs (cuDNN's algorithm search, allocator growth) stay out of the rate.
                started, samples = clock(), 0
            t0 = clock(phase=True)
            img, labels = img.to(dev, non_blocking=True), labels.to(dev, non_blocking=True)
            embeddings = backbone(img.to(dtype))
            t1 = clock(phase=True)
            loss = head(embeddings, labels)
            t2 = clock(phase=True)
            # train_v2.py's gradient_acc: backward every batch, the step on global steps that
            # are multiples of it, the schedule every batch.
            window_ends = step % args.gradient_acc == 0
            if scaler is not None:
                scaler.scale(loss).backward()
                t3 = clock(phase=True)
                if window_ends:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(backbone.parameters(), args.clip)
                    scaler.step(opt)
                    scaler.update()
            else:
                loss.backward()
                t3 = clock(phase=True)
                if window_ends:
                    torch.nn.utils.clip_grad_norm_(backbone.parameters(), args.clip)
                    opt.step()
            if window_ends:
                opt.zero_grad()
            sched.step()
            t4 = clock(phase=True)
            for k, (a, b) in {"data": (waited, t0), "forward": (t0, t1), "head": (t1, t2),
                              "backward": (t2, t3), "optimizer": (t3, t4)}.items():
                times[k] += b - a
            samples += img.shape[0] * args.world
            waited = time.perf_counter()
        if args.steps and step >= args.steps:
            break
    elapsed = clock() - started
    import resource
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
    peaks = [torch.zeros_like(peak) for _ in range(args.world)]
    dist.all_gather(peaks, peak)
    if rank == 0:
        if args.out:
            torch.save(backbone.module.state_dict(), args.out)
        per = {k: v * 1e3 / max(step, 1) for k, v in times.items()}
        print("step_ms " + " ".join(f"{k}={v:.1f}" for k, v in per.items()), flush=True)
        print("peak_rss_bytes=" + ",".join(str(int(p.item())) for p in peaks), flush=True)
        if cuda:
            print(f"gpu_peak_bytes={torch.cuda.max_memory_allocated()}", flush=True)
        print(f"steps={step} loss={loss.item():.6f} samples/s={samples / max(elapsed, 1e-9):.3f}", flush=True)
        # The same figures as one JSON line, what `tandem bench face` reads.
        print("RESULT " + json.dumps({
            "samples_per_s": samples / max(elapsed, 1e-9),
            "peak_rss_bytes": [int(p.item()) for p in peaks],
            "step_ms": [[k, v] for k, v in per.items()],
            "gpu_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        }), flush=True)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["init", "train", "verify"])
    p.add_argument("--pairs")
    p.add_argument("out_pos", nargs="?")
    p.add_argument("--classes", type=int)
    p.add_argument("--depth", type=int, default=18)
    p.add_argument("--network", default=None,
                   help="arcface_torch's name (r18 .. r200, mbf, mbf_large, vit_*) or iresnetN; overrides --depth")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--embedding", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data")
    p.add_argument("--init")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--margin", default="1.0,0.5,0.0")
    p.add_argument("--scale", type=float, default=64.0)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--gradient-acc", type=int, default=1,
                   help="arcface_torch's gradient_acc: batches summed per optimizer step")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: all)")
    p.add_argument("--double", action="store_true", help="train in float64 (the float32 runs' reference)")
    p.add_argument("--sample-rate", type=float, default=1.0, help="PartialFC v2's sample_rate")
    p.add_argument("--no-head", action="store_true", help="init: write the backbone only")
    p.add_argument("--out")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N] (every rank on that GPU)")
    p.add_argument("--amp", default="none", choices=["none", "f16", "bf16"],
                   help="arcface_torch's fp16: the backbone and logits under torch.autocast, "
                        "a GradScaler for f16 (GPU)")
    p.add_argument("--profile", action="store_true",
                   help="wait for the GPU at every phase boundary so step_ms splits the time "
                        "(slows the run); without it only the total is timed")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="steps left out of samples/s (cuDNN's algorithm search runs in the first)")
    args = p.parse_args()
    if args.mode in ("init", "verify"):
        args.out = args.out or args.out_pos
        (init if args.mode == "init" else verify)(args)
    else:
        mp.spawn(worker, args=(args, free_port()), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
