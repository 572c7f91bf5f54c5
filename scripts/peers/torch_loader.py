# PyTorch's side of `tandem bench loader`: images/s of torch.utils.data.DataLoader over an
# insightface RecordIO folder, decoded as arcface_torch's MXFaceDataset does (JPEG -> RGB,
# random horizontal flip, to float in [-1, 1], CHW), for each worker count.
# usage: python torch_loader.py FACES_DIR BATCH BATCHES REPEATS W1,W2,...
# prints, per worker count, `workers=W images_per_s=R` and the same as `RESULT {json}` (what tandem reads)
import io, json, os, sys, time

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_face_recipe import RecFaces  # noqa: E402


class Decoded(torch.utils.data.Dataset):
    def __init__(self, root):
        self.rec = RecFaces(root)

    def __len__(self):
        return len(self.rec.keys)

    def __getitem__(self, i):
        flag, labels, img = self.rec.header(self.rec.keys[i])
        a = np.asarray(Image.open(io.BytesIO(img)).convert("RGB"), dtype=np.float32)
        if np.random.rand() < 0.5:
            a = a[:, ::-1]
        a = (a / 255.0 - 0.5) / 0.5
        return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))), int(labels[0])


root, batch, batches, repeats, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.set_num_threads(1)
data = Decoded(root)
for w in (int(v) for v in workers.split(",")):
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, drop_last=True,
                                         num_workers=w, persistent_workers=w > 0)
    best = 0.0
    for _ in range(repeats):
        t, images = time.perf_counter(), 0
        while images < batch * batches:
            for x, _ in loader:
                images += x.shape[0]
                if images >= batch * batches:
                    break
        best = max(best, images / (time.perf_counter() - t))
    print(f"workers={w} images_per_s={best:.1f}", flush=True)
    print("RESULT " + json.dumps({"workers": w, "images_per_s": best}), flush=True)
