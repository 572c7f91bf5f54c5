#!/usr/bin/env bash
# #69's "survivor replaced after the second kill" scenario, N times in a row (default 50): a
# 4-rank live job (`tandem run --nproc-per-node 4 --max-restarts 3 --live-recovery -- tandem
# train --epochs 400`) with one worker SIGKILLed once it trains and another 2-4 s later. A run
# passes when the job exits 0 with a final line and exactly the two killed ranks failed (no
# survivor stopped or restarted). Prints each failing run (its log kept in $OUT, default
# /tmp/live-two-kills) and the total. Needs `cargo build --release` first.
set -uo pipefail
cd "$(dirname "$0")/.."
bin="$PWD/target/release/tandem"
out="${OUT:-/tmp/live-two-kills}"
mkdir -p "$out"
n="${N:-50}" fails=0 start=$(date +%s)
for i in $(seq 1 "$n"); do
  dir=$(mktemp -d)
  (cd "$dir" && exec "$bin" run --nproc-per-node 4 --max-restarts 3 --live-recovery -- \
    "$bin" train --epochs 400 --out runs/s > log 2>&1) &
  job=$!
  for _ in $(seq 200); do grep -q "epoch 2/" "$dir/log" 2>/dev/null && break; sleep 0.05; done
  workers() { pgrep -f "^$bin train --epochs 400 --out runs/s"; }
  kill -9 "$(workers | shuf -n1 --random-source=<(yes "$i"))"
  sleep $(( (i % 3) + 2 ))
  kill -9 "$(workers | shuf -n1 --random-source=<(yes "x$i"))"
  wait "$job"; rc=$?
  failed=$(grep -c "\[launcher\] rank .* failed" "$dir/log")
  killed=$(grep -c "\[launcher\] rank .* failed (signal 9 (SIGKILL))" "$dir/log")
  if [ "$rc" -ne 0 ] || [ "$failed" != 2 ] || [ "$killed" != 2 ] || ! grep -q "final: " "$dir/log"; then
    fails=$((fails + 1))
    echo "run $i: exit $rc, $failed rank failure(s), $killed SIGKILL(s): $out/run-$i.log"
    cp "$dir/log" "$out/run-$i.log"
  fi
  rm -rf "$dir"
done
echo "live two kills: $n runs, $fails failed, $(( $(date +%s) - start )) s"
[ "$fails" -eq 0 ]
