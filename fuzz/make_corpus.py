# Writes the seed corpora under fuzz/seeds/<target>/ (committed; runs copy them to a working
# corpus): small valid inputs of each format (so
# libFuzzer starts from files that get past the first checks) made with real pickle/numpy and
# the formats' documented layouts. Run from the repository root:
#     .venv-torch/bin/python fuzz/make_corpus.py
import json, os, pickle, shutil, struct
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "seeds")


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# .pt / pickle: the ckpt crate's small fixtures (written by torch; see its make_fixtures.py).
fixtures = os.path.join(ROOT, "crates", "tandem-ckpt", "tests", "fixtures")
for name in ["views_legacy.pt", "complex.pt", "python_values.pt", "views.pt", "nested_legacy.pt"]:
    with open(os.path.join(fixtures, name), "rb") as f:
        put("read_checkpoint", name, f.read())

# insightface .bin: (images, issame) with tiny "images", as bytes and as numpy arrays.
imgs = [bytes([i] * 8) for i in range(4)]
flags = [True, False]
put("verification_bin", "bytes_p4.bin", pickle.dumps((imgs, flags), protocol=4))
arrays = [np.frombuffer(b, dtype=np.uint8) for b in imgs]
put("verification_bin", "numpy_p2.bin", pickle.dumps((arrays, np.array(flags)), protocol=2))
put("verification_bin", "numpy_p5.bin", pickle.dumps((arrays, np.array(flags)), protocol=5))


# RecordIO (dmlc): magic, (cflag << 29 | length), payload, padding to 4; IRHeader `<IfQQ`.
def record(payload):
    out = struct.pack("<II", 0xCED7230A, len(payload)) + payload
    return out + b"\0" * (-len(payload) % 4)


def ir(label, payload, labels=()):
    head = struct.pack("<IfQQ", len(labels), 0.0 if labels else label, 0, 0)
    return head + b"".join(struct.pack("<f", l) for l in labels) + payload


recs, idx, offset = b"", "", 0
for key, rec in [(0, ir(0, b"", (3.0, 5.0))), (1, ir(0, b"\x89PNG")), (2, ir(1, b"\xff\xd8"))]:
    idx += f"{key}\t{offset}\n"
    r = record(rec)
    recs += r
    offset += len(r)
put("recordio", "header_and_two_images", struct.pack("<H", len(idx)) + idx.encode() + recs)


# Store and mesh frames: u32 little-endian length + payload; fields u32-length-prefixed.
def frame(payload):
    return struct.pack("<I", len(payload)) + payload


def field(b):
    return struct.pack("<I", len(b)) + b


hello = frame(field(b"tandem-store/2") + field(b"fuzz") + field(b"\0" * 32))
reqs = frame(b"\x01" + field(b"key") + field(b"value"))  # SET
reqs += frame(b"\x02" + field(b"key") + struct.pack("<Q", 0))  # GET
reqs += frame(b"\x04" + field(b"n") + struct.pack("<Q", 5))  # ADD
reqs += frame(b"\x03" + struct.pack("<Q", 1) + field(b"key") + struct.pack("<Q", 0))  # WAIT
reqs += frame(b"\x05" + field(b"key") + field(b"value") + field(b"new"))  # CAS
reqs += frame(b"\x07" + field(b"mine") + field(b"1"))  # SET_OWNED
reqs += frame(b"\x06" + field(b"key"))  # DELETE
put("store_frames", "open_session", b"\0" + hello + reqs)
put("store_frames", "secret_session", b"\1" + hello + frame(field(b"\0" * 32)) + reqs)
mesh = frame(field(b"tandem-mesh/2") + field(b"fuzz") + field(b"w") + struct.pack("<Q", 1) + field(b"\0" * 32))
put("mesh_hello", "open_hello", b"\0" + mesh)
put("mesh_hello", "secret_hello", b"\1" + mesh + frame(field(b"\0" * 32)))

# Checkpoint manifests: the face recipe's earlier format (two ranks' heads) and today's
# (row, entry and rank shards).
manifest = {
    "format": "tandem-partial-fc-1", "world_size": 2, "global_step": 8, "epoch": 1,
    "num_classes": 10, "embedding_size": 4, "replicated": "replicated.pt",
    "heads": [{"file": "head-rank-00000-of-00002.pt", "start": 0, "len": 5},
              {"file": "head-rank-00001-of-00002.pt", "start": 5, "len": 5}],
}
put("checkpoint_manifest", "face_two_ranks.json", json.dumps(manifest, indent=1).encode())
state = {
    "format": "tandem-state-1", "world_size": 2, "global_step": 8, "epoch": 1,
    "replicated": "replicated.pt",
    "ranks": [{"file": f"rank-0000{r}-of-00002.pt", "shards": [
        {"name": "head", "kind": "rows", "start": 5 * r, "len": 5, "total": 10},
        {"name": "optimizer/state", "kind": "entries", "indices": [r, r + 2]},
        {"name": "buffers", "kind": "rank"}]} for r in range(2)],
}
put("checkpoint_manifest", "state_two_ranks.json", json.dumps(state, indent=1).encode())

# `tandem train --config` files: the seed's recipe and a small classifier one.
with open(os.path.join(ROOT, "configs", "arcface_ms1mv3_r50.toml"), "rb") as f:
    put("train_config", "arcface_ms1mv3_r50.toml", f.read())
put("train_config", "classifier.toml", b'model = "cnn"\nepochs = 2\nlr = 0.05\nbatch-size = 64\nlr-scheduler = "poly"\n')

# arcface_torch's Python configs (`--config FILE.py`): a few of its own, and nesting and
# arithmetic at the reader's edges.
for name in ["base.py", "ms1mv3_r50.py", "glint360k_mbf.py", "wf42m_pfc03_40epoch_8gpu_vit_b.py"]:
    with open(os.path.join(ROOT, "crates", "tandem-recipes", "tests", "fixtures", "arcface_configs", name), "rb") as f:
        put("arcface_config", name, f.read())
put("arcface_config", "edge.py", b"config.a = ((((((1))))))\nconfig.b = config.a // 0\n")
print("corpora:", sorted(os.listdir(CORPUS)))

# PyTorch distributed checkpoint metadata (`.metadata`): what dcp.save writes for a replicated
# state dict and for non-tensor values, in one process.
import tempfile  # noqa: E402

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

for name, sd in [
    ("model", {"model": torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).state_dict()}),
    ("objects", {"w": torch.arange(6.0).reshape(2, 3), "step": 7, "lr": [0.1, 0.2], "name": "x"}),
]:
    with tempfile.TemporaryDirectory() as d:
        dcp.save(sd, checkpoint_id=d, no_dist=True)
        with open(os.path.join(d, ".metadata"), "rb") as f:
            put("dcp_metadata", name, f.read())
