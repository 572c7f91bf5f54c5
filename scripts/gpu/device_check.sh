#!/bin/bash
# The device check of issue #55, run on the device machine (one H100/H200, its Python holding
# PyTorch with CUDA, cuDNN and NCCL wheels) from the repository root, with .gpu/ (made here by
# scripts/gpu/build_for_device.sh) carried along:
#
#   device run: bash scripts/gpu/device_check.sh        (carry: [".gpu"], timeout ~560 s)
#
# In order, each step's output in $OUT (what comes back) and a line per step on the console:
#   1. cuda_twins: every CUDA path against its CPU twin (TANDEM_REQUIRE_CUDA=1);
#   2. the face recipe at arcface_torch's setting, tandem vs PyTorch in alternating rounds:
#      IResNet-50 w64, 512-d, PartialFC 1M classes at 0.1, batch 128, f16, 10 warm-up steps;
#   3. conv table: each distinct IResNet-50 convolution (and BatchNorm, PReLU) forward and
#      forward+backward, tandem vs PyTorch, f16 at batch 128;
#   4. CIFAR ResNet-18, batch 256, f32 and f16, 1 rank, tandem vs PyTorch;
#   5. one profiled tandem run of the face recipe: device-true phases and time per kernel.
# A step that fails is reported and the next one runs; the exit code is the first failure's.
set -uo pipefail
out="${OUT:-/tmp/tandem-device}"
mkdir -p "$out"
budget_end=$(( $(date +%s) + ${DEVICE_BUDGET_S:-540} ))
py="${TANDEM_PYTHON:-python3}"
export TANDEM_PYTHON="$py"
site="$("$py" -c 'import site; print(site.getsitepackages()[0])')"
# The CUDA libraries of PyTorch's wheels (cuBLAS, cuDNN, NCCL, the runtime, NVRTC, cuRAND).
libs="$(ls -d "$site"/nvidia/*/lib 2>/dev/null | tr '\n' ':')"
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:-}"
bin=/tmp/tandem-gpu
mkdir -p "$bin"
for f in .gpu/*.xz; do xz -dc "$f" > "$bin/$(basename "$f" .xz)"; done
chmod +x "$bin"/*
status=0
step() {  # step NAME SECONDS CMD...: runs CMD with a timeout, its output in $OUT/NAME.log
  local name="$1" secs="$2"; shift 2
  local left=$(( budget_end - $(date +%s) ))
  [ "$left" -lt 20 ] && { echo "== $name: skipped (device budget spent)"; return; }
  [ "$secs" -gt "$left" ] && secs="$left"
  local t0; t0=$(date +%s)
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $(( $(date +%s) - t0 )) s"
  [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc
  tail -n "${TAIL:-25}" "$out/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
"$py" -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())' 2>&1 | tee -a "$out/gpu.txt"

TAIL=40 step twins 150 env TANDEM_REQUIRE_CUDA=1 "$bin/cuda_twins"
face=(--device cuda --precision f16 --nproc 1 --model iresnet50 --width 64 --embedding 512
      --classes 1000000 --sample-rate 0.1 --batch 128 --identities 256 --workers 6 --torch-workers 6)
step face 280 "$bin/tandem-bench" face "${face[@]}" --steps 40 --warmup-steps 10 --rounds 2 \
  --dir /tmp/tandem-face
step conv 100 "$bin/tandem-bench" conv --net iresnet18 --width 64 --batch 128 --device cuda \
  --dtype f16 --repeats 10 --torch "$py"
for precision in f32 f16; do
  step "resnet18-$precision" 70 "$bin/tandem-bench" ddp --device cuda --nproc 1 --model resnet18 \
    --width 64 --batch 256 --steps 30 --rounds 3 --precision "$precision" --torch "$py"
done
if [ -f /tmp/tandem-face/faces/train.rec ]; then
  step profile 70 env TANDEM_PROFILE=ops "$bin/tandem" train --nproc-per-node 1 --model iresnet50 \
    --width 64 --embedding-size 512 --num-classes 1000000 --sample-rate 0.1 --batch-size 128 \
    --precision f16 --device cuda --data rec:/tmp/tandem-face/faces --epochs 1000 --steps 20 \
    --lr 0.1 --lr-scheduler poly --clip-grad-norm 5 --no-checkpoints --out /tmp/tandem-profile
fi
exit "$status"
