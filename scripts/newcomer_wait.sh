#!/usr/bin/env bash
# A newcomer's wait, measured: clone COMMIT into a fresh directory with a fresh target directory,
# then time the README's two commands (the main job, then the test suite). The crates.io cache
# (~/.cargo/registry) is reused, so downloads are not counted; run it on an otherwise idle
# machine and repeat it.
#
#   scripts/newcomer_wait.sh COMMIT "cargo test --release --workspace" [WORKDIR]
# prints: COMMIT train_rc=R S s; test_rc=R S s; total S s
set -u
commit=$1; test_cmd=$2; work=${3:-$(mktemp -d)}
repo=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$work/clone"
git clone -q "$repo" "$work/clone" && cd "$work/clone" && git checkout -q "$commit" || exit 1
export CARGO_TARGET_DIR="$work/clone/target"
t0=$(date +%s.%N)
cargo run --release -- train > "$work/train.log" 2>&1; rc1=$?
t1=$(date +%s.%N)
$test_cmd > "$work/test.log" 2>&1; rc2=$?
t2=$(date +%s.%N)
printf '%s train_rc=%s %.0f s; test_rc=%s %.0f s; total %.0f s (logs in %s)\n' "$commit" \
  "$rc1" "$(echo "$t1 - $t0" | bc)" "$rc2" "$(echo "$t2 - $t1" | bc)" "$(echo "$t2 - $t0" | bc)" "$work"
