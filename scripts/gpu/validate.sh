#!/bin/bash
# Issue #55's device check, in one call of the device tool on one H100/H200 (its Python holding
# PyTorch with the CUDA, cuDNN and NCCL wheels), from the repository root, with .gpu/ (made
# beforehand on the CPU machine by scripts/gpu/build_for_device.sh) carried along:
#
#   device run: bash scripts/gpu/validate.sh        (carry: [".gpu"], timeout_s ~560)
#   CI, on CPU: bash scripts/gpu/validate.sh --dry-run
#
# Stages, in order of value, each under its own timeout and inside a total budget
# (VALIDATE_BUDGET_S, default 470 s: ≤ 8 minutes), each appending its files to $OUT (what
# the device tool brings back), so a stage that times out still leaves the others' data:
#   env      GPU, driver, CUDA, torch, cuDNN                            env.txt
#   twins    every CUDA path against its CPU twin (TANDEM_REQUIRE_CUDA=1) twins.log
#   face     the face recipe at arcface_torch's setting, tandem and PyTorch in alternating
#            rounds: IResNet-50 w64, 512-d, PartialFC 1M classes at 0.1, batch 128, f16
#                                                                       face.json, face.log
#   conv     per op: each distinct IResNet-50 convolution (forward, backward-data,
#            backward-filter), BatchNorm and PReLU, f16 at batch 128, against PyTorch
#                                                                       conv.json, conv.log
#   nccl-fp16  Ddp over NCCL with the fp16 hook and gradient accumulation  nccl-fp16.log
#   busy     tandem's face recipe alone while nvidia-smi samples GPU utilisation
#            (the share of time a kernel runs)                          busy.txt, busy.log
#   resnet18-f32, resnet18-f16   CIFAR ResNet-18, batch 256, 1 rank, against PyTorch
#                                                                       resnet18-*.json
#   profile  one TANDEM_PROFILE=ops run: device time per op             profile.log
# then `tandem bench report --gpu $OUT --out $OUT`: validate.json, gpu_validate.md and a
# BENCHMARKS.md holding the GPU section (here: `tandem bench report --gpu DIR` puts it into
# docs/BENCHMARKS.md). The head and the optimizer over the 1M rows are timed as the face
# stage's phases (both sides print their split).
#
# --dry-run: the same stages on the CPU at toy sizes with this checkout's release build
# (target/release: run the README's test command first), so the script and the report never
# rot. Exit code: the first failed stage's.
set -uo pipefail
cd "$(dirname "$0")/../.."
dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  *) echo "usage: scripts/gpu/validate.sh [--dry-run]" >&2; exit 2 ;;
esac
out="${OUT:-/tmp/tandem-validate}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="${VALIDATE_WORK:-$out/work}"
mkdir -p "$work"
budget_end=$(( $(date +%s) + ${VALIDATE_BUDGET_S:-470} ))
py="${TANDEM_PYTHON:-}"
if [ -z "$py" ]; then
  py=python3
  [ -x .venv-torch/bin/python ] && py="$PWD/.venv-torch/bin/python"
fi
export TANDEM_PYTHON="$py"
: > "$out/stages.tsv"

if [ "$dry" = 1 ]; then
  bin="$PWD/target/release"
  twins="$(ls -t target/release/deps/cuda_twins-* 2>/dev/null | grep -v '\.d$' | head -1)"
  device=cpu
else
  site="$("$py" -c 'import site; print(site.getsitepackages()[0])')"
  # The CUDA libraries of PyTorch's wheels (cuBLAS, cuDNN, NCCL, the runtime, NVRTC, cuRAND).
  libs="$(ls -d "$site"/nvidia/*/lib "$site"/nvidia/cu13/lib 2>/dev/null | tr '\n' ':')"
  export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:-}"
  bin=/tmp/tandem-gpu
  mkdir -p "$bin"
  for f in .gpu/*.xz; do xz -dc "$f" > "$bin/$(basename "$f" .xz)"; done
  chmod +x "$bin"/*
  twins="$bin/cuda_twins"
  device=cuda
fi

status=0
# stage NAME SECONDS CMD...: CMD under a timeout, its output in $OUT/NAME.log, a line in
# stages.tsv and on the console.
stage() {
  local name="$1" secs="$2"; shift 2
  local left=$(( budget_end - $(date +%s) ))
  if [ "$left" -lt 15 ]; then
    echo "== $name: skipped (budget spent)"
    printf '%s\t%s\t%s\n' "$name" 125 0 >> "$out/stages.tsv"
    return
  fi
  [ "$secs" -gt "$left" ] && secs="$left"
  local t0; t0=$(date +%s)
  if declare -F "$1" > /dev/null; then
    # A function of this script: it puts its own commands under timeout $STAGE_S.
    STAGE_S="$secs" "$@" > "$out/$name.log" 2>&1
  else
    timeout -k 5 "$secs" "$@" > "$out/$name.log" 2>&1
  fi
  local rc=$?
  local took=$(( $(date +%s) - t0 ))
  printf '%s\t%s\t%s\n' "$name" "$rc" "$took" >> "$out/stages.tsv"
  echo "== $name: exit $rc in $took s"
  [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc
  tail -n "${TAIL:-12}" "$out/$name.log"
}

environment() {
  local t=(timeout -k 2 10)
  {
    echo "dry_run=$dry"
    echo "date=$(date -u +%Y-%m-%dT%H:%MZ)"
    if command -v nvidia-smi > /dev/null; then
      "${t[@]}" nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader |
        head -1 | awk -F', ' '{print "gpu=" $1 " (" $3 ")"; print "driver=" $2}'
      echo "cuda=$("${t[@]}" nvidia-smi | grep -o 'CUDA Version: [0-9.]*' | awk '{print $3}')"
    else
      echo "gpu=none (CPU dry run)"
    fi
    "${t[@]}" "$py" -c 'import torch; print("torch=" + torch.__version__); print("cudnn=" + str(torch.backends.cudnn.version()))' \
      2>/dev/null || echo "torch=not found ($py)"
  } > "$out/env.txt"
  cat "$out/env.txt"
}

# Sizes: arcface_torch's on the GPU, toys in the dry run.
if [ "$dry" = 1 ]; then
  face=(--model iresnet18 --width 4 --embedding 16 --classes 2000 --sample-rate 0.1 --batch 4
        --identities 16 --steps 3 --warmup-steps 1 --rounds 1 --precision f32)
  conv=(--width 4 --batch 2 --repeats 1 --dtype f32)
  resnet=(--width 4 --batch 8 --steps 2 --rounds 1)
  train=(--model iresnet18 --width 4 --embedding-size 16 --num-classes 2000 --sample-rate 0.1
         --batch-size 4 --steps 3)
else
  face=(--model iresnet50 --width 64 --embedding 512 --classes 1000000 --sample-rate 0.1
        --batch 128 --identities 256 --workers 6 --torch-workers 6 --steps 40 --warmup-steps 10
        --rounds 2 --precision f16)
  conv=(--width 64 --batch 128 --repeats 10 --dtype f16)
  resnet=(--width 64 --batch 256 --steps 30 --rounds 3)
  train=(--model iresnet50 --width 64 --embedding-size 512 --num-classes 1000000
         --sample-rate 0.1 --batch-size 128 --precision f16 --num-workers 6 --steps 60)
fi

# train_face RUN_DIR: tandem's face recipe alone on the face stage's data, under $STAGE_S.
train_face() {
  timeout -k 5 "$STAGE_S" "$bin/tandem" train --nproc-per-node 1 "${train[@]}" \
    --device "$device" --data "rec:$work/face/faces" --epochs 1000 --lr 0.1 \
    --lr-scheduler poly --clip-grad-norm 5 --no-checkpoints --out "$1"
}

# The face recipe alone while nvidia-smi samples utilisation every 200 ms; the first third
# (start-up, data loading) is left out.
busy() {
  local samples="$work/busy-samples.txt"
  : > "$samples"
  local sampler=""
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 200 > "$samples" &
    sampler=$!
  fi
  train_face "$work/busy-run"
  local rc=$?
  [ -n "$sampler" ] && kill "$sampler" 2> /dev/null
  local n; n=$(wc -l < "$samples")
  tail -n +"$(( n / 3 + 1 ))" "$samples" > "$out/busy.txt"
  return $rc
}

profile() {
  TANDEM_PROFILE=ops train_face "$work/profile-run"
}

TAIL=8 stage env 20 environment
if [ -n "$twins" ] && [ -x "$twins" ]; then
  require=(env TANDEM_REQUIRE_CUDA=1)
  [ "$dry" = 1 ] && require=(env)  # a CPU build skips them, saying why
  TAIL=30 stage twins 90 "${require[@]}" "$twins"
else
  stage twins 5 sh -c 'echo "no cuda_twins test binary (build the tests first)"; exit 1'
fi
stage face 200 "$bin/tandem-bench" face --device "$device" --nproc 1 "${face[@]}" \
  --dir "$work/face" --json "$out/face.json"
stage conv 70 "$bin/tandem-bench" conv --net iresnet18 --device "$device" "${conv[@]}" \
  --torch "$py" --json "$out/conv.json"
if [ -f "$work/face/faces/train.rec" ]; then
  # Ddp's NCCL path with arcface_torch's fp16 compression hook and gradient accumulation
  # (no_sync sums kept on the GPU), one rank (NCCL's own path all the same), a small IResNet;
  # the dry run takes tcp on the CPU.
  backend=nccl
  [ "$dry" = 1 ] && backend=tcp
  stage nccl-fp16 40 "$bin/tandem" train --model iresnet18 --width 16 --embedding-size 128 \
    --batch-size 16 --device "$device" --backend "$backend" --comm-hook fp16 --gradient-acc 2 \
    --nproc-per-node 1 --data "rec:$work/face/faces" --epochs 1000 --steps 8 \
    --no-checkpoints --out "$work/nccl-run"
  stage busy 45 busy
  for precision in f32 f16; do
    p="$precision"
    [ "$dry" = 1 ] && p=f32  # the CPU rounds instead of computing in f16: nothing to time
    stage "resnet18-$precision" 45 sh -c '"$@" > "'"$out/resnet18-$precision.json"'"' _ \
      "$bin/tandem-bench" ddp --device "$device" --nproc 1 --model resnet18 "${resnet[@]}" \
      --precision "$p" --torch "$py" --json
  done
  stage profile 40 profile
else
  echo "== busy, profile: no face data (the face stage did not make $work/face/faces)"
fi
TAIL=60 stage report 30 "$bin/tandem-bench" report --gpu "$out" --out "$out"
exit "$status"
