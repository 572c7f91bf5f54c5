#!/usr/bin/env bash
# The convolution-speed work measured against the revision before it, in one run on this
# machine: ResNet-18 (CIFAR) per-op times at widths 16 and 64 (the ops the base revision's
# `tandem bench conv` covers), then whole-model ratios against PyTorch (2-rank DDP at widths 16
# and 64, the small Cnn, the face recipe), each measured by the base binary and by this tree's
# binary in alternation. Writes markdown to stdout; docs/bench_conv_before_after.md holds the
# last run (`tandem bench report` embeds it). A measurement that fails is said on stderr and
# left out of its row (a row with none left says so).
#
# usage: scripts/conv_before_after.sh [BASE_REV] [ROUNDS]
#   BASE_REV  default 077cbf3 (the tree before the kernel work of the convolution-speed issue)
#   ROUNDS    alternating rounds per whole-model figure (default 3; min / median / max)
#   PARTS=ops,models   which halves to run (default both)
#   ROWS=resnet18-16,resnet18-64,cnn,face   which whole-model rows (default all)
#   BASE_BUILD=DIR     keep the base revision's build in DIR and reuse it next time
# Needs a Python with torch (TANDEM_PYTHON or .venv-torch/bin/python) and ~8 minutes for the
# base revision's cold build (in a scratch worktree, removed afterwards). Run it on a quiet
# machine: nothing else may rebuild target/release/tandem while it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
base="${1:-077cbf3}"
rounds="${2:-3}"
python="${TANDEM_PYTHON:-$PWD/.venv-torch/bin/python}"
"$python" -c 'import torch' 2>/dev/null || { echo "no torch in $python (set TANDEM_PYTHON)" >&2; exit 1; }

parts="${PARTS:-ops,models}"
rows="${ROWS:-resnet18-16,resnet18-64,cnn,face}"
scratch="$(mktemp -d)"
cleanup() { git worktree remove --force "$scratch/base" 2>/dev/null || true; rm -rf "$scratch"; }
trap cleanup EXIT
base_build="${BASE_BUILD:-$scratch/target}"
old="$base_build/release/tandem"
if [ ! -x "$old" ]; then
  git worktree add --detach --quiet "$scratch/base" "$base"
  echo "building $base ..." >&2
  (cd "$scratch/base" && CARGO_TARGET_DIR="$base_build" cargo build --release --quiet -p tandem-cli -p tandem-bench)
fi
cargo build --release --quiet -p tandem-cli -p tandem-bench
# A copy: a rebuild of the tree while this runs must not swap the binary under it. `tandem
# bench` runs the `tandem-bench` beside it, so both keep their names.
mkdir -p "$scratch/new"
cp target/release/tandem target/release/tandem-bench "$scratch/new/"
new="$scratch/new/tandem"
head_rev="$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo +changes)"

# One column of `bench conv`'s table: the op name (2nd cell) and the cell numbered $2.
column() { awk -F'|' -v c="$2" '/^\| conv2d|^\| batch_norm/ { gsub(/ /, "", $3); gsub(/ /, "", $(c + 1)); print $3, $(c + 1) }' "$1"; }

echo "# Convolution speed: $base against $head_rev"
echo
echo "Measured $(date -u '+%Y-%m-%d %H:%M UTC') by \`scripts/conv_before_after.sh $base $rounds\` on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))."
echo
for width in $(case ",$parts," in *,ops,*) echo 16 64 ;; esac); do
  RAYON_NUM_THREADS=1 "$old" bench conv --width "$width" --batch 32 --repeats 9 > "$scratch/old.$width"
  RAYON_NUM_THREADS=1 "$new" bench conv --net resnet18 --width "$width" --batch 32 --repeats 9 > "$scratch/new.$width"
  echo "## ResNet-18 (CIFAR) ops at width $width, batch 32, one thread: forward + backward, median ms"
  echo
  echo "| op | $base | $head_rev | speed-up |"
  echo "|---|--:|--:|--:|"
  join <(column "$scratch/old.$width" 6 | sort) <(column "$scratch/new.$width" 6 | sort) |
    awk '{ printf "| %s | %.3f | %.3f | %.2fx |\n", $1, $2, $3, $2 / $3 }' | sort -t'|' -k2,2
  echo
done

# min / median / max of a list of numbers.
stats() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) printf "failed"; else printf "%.2f / %.2f / %.2f", v[1], v[int((NR + 1) / 2)], v[NR] }'; }
# Runs a measurement; a failure is reported and skipped rather than ending the script.
try() { "$@" || echo "conv_before_after: failed, left out: ${*:2}" >&2; }
# tandem / PyTorch of one `bench ddp --torch` run.
ddp_ratio() { "$1" bench ddp --model "$2" --width "$3" --batch "$4" --steps "$5" --rounds 3 --torch "$python" 2>/dev/null | awk '/torch DDP/ { for (i = 1; i <= NF; i++) if ($i ~ /^tandem\/torch$/) print $(i + 1) }'; }
face_ratio() { "$1" bench face --rounds 1 --python "$python" 2>/dev/null | sed -n 's/.*tandem \/ PyTorch (medians): \(samples\/s \)\{0,1\}\([0-9.]*\)x.*/\2/p'; }

case ",$parts," in *,models,*) ;; *) exit 0 ;; esac
echo "## Whole models, tandem / PyTorch on the same machine (min / median / max of $rounds rounds)"
echo
echo "| workload | $base | $head_rev |"
echo "|---|--:|--:|"
for spec in "resnet18 16 64 4" "resnet18 64 64 3" "cnn 1 128 10"; do
  set -- $spec
  case ",$rows," in *",$1-$2,"*|*",$1,"*) ;; *) continue ;; esac
  : > "$scratch/a"; : > "$scratch/b"
  for _ in $(seq "$rounds"); do
    try ddp_ratio "$old" "$@" >> "$scratch/a"
    try ddp_ratio "$new" "$@" >> "$scratch/b"
  done
  name="2-rank DDP $1"
  if [ "$1" = resnet18 ]; then name="$name width $2"; fi
  echo "| $name | $(stats < "$scratch/a") | $(stats < "$scratch/b") |"
done
case ",$rows," in *,face,*) ;; *) exit 0 ;; esac
: > "$scratch/a"; : > "$scratch/b"
for _ in $(seq "$rounds"); do
  try face_ratio "$old" >> "$scratch/a"
  try face_ratio "$new" >> "$scratch/b"
done
echo "| face recipe (IResNet-18 w16, 2 ranks) | $(stats < "$scratch/a") | $(stats < "$scratch/b") |"
