#!/usr/bin/env bash
# Multi-host benchmark on simulated hosts (network namespaces on one bridge, each host's link
# rate-limited): all-reduce busbw of the flat TCP ring vs the hierarchical all-reduce, and DDP
# training samples/s with and without gradient compression. Needs root and iproute2 (the same
# setup as crates/tandem-cli/tests/multihost.rs). Prints markdown tables; keep them in
# docs/bench_two_hosts.md, which `tandem bench report` includes in docs/BENCHMARKS.md.
#
#   sudo scripts/bench_two_hosts.sh [HOSTS] [RATE_MBIT] [REPEATS] [TRAIN_RATE_MBIT]
#   (defaults: 2 1000 3 100: all-reduce on 1 Gbit/s links, training on 100 Mbit/s links)
#
# BENCH_PARTS=allreduce or BENCH_PARTS=train runs one of the two tables.
# Rate limiting uses netem (rate + 0.2 ms delay) when the kernel has sch_netem, else a tbf
# qdisc (rate only); the table header says which.
set -euo pipefail
hosts=${1:-2}
rate=${2:-1000}
repeats=${3:-3}
train_rate=${4:-100}
root=$(cd "$(dirname "$0")/.." && pwd)
tandem=${TANDEM:-$root/target/release/tandem}
[ -x "$tandem" ] || { echo "build first: cargo build --release ($tandem missing)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces)" >&2; exit 1; }

id="tdb$$"
sw="${id}sw"
cleanup() {
  for i in $(seq 0 $((hosts - 1))); do ip netns del "${id}h$i" 2>/dev/null || true; done
  ip netns del "$sw" 2>/dev/null || true
}
trap cleanup EXIT
ip netns add "$sw"
ip -n "$sw" link add br0 type bridge
ip -n "$sw" link set br0 up
shaping=""
for i in $(seq 0 $((hosts - 1))); do
  ns="${id}h$i"
  ip netns add "$ns"
  ip link add "eth$i" netns "$ns" type veth peer name "port$i" netns "$sw"
  ip -n "$sw" link set "port$i" master br0
  ip -n "$sw" link set "port$i" up
  ip -n "$ns" addr add "10.78.0.$((i + 1))/24" dev "eth$i"
  ip -n "$ns" link set "eth$i" up
  ip -n "$ns" link set lo up
  if ip netns exec "$ns" tc qdisc add dev "eth$i" root netem delay 0.2ms rate "${rate}mbit" 2>/dev/null; then
    shaping="netem rate ${rate} Mbit/s, delay 0.2 ms"
  else
    burst=$(( rate * 1000 / 8 > 65536 ? rate * 1000 / 8 : 65536 ))
    ip netns exec "$ns" tc qdisc add dev "eth$i" root tbf rate "${rate}mbit" burst "$burst" latency 50ms
    shaping="tbf rate ${rate} Mbit/s (no sch_netem in this kernel: no added delay)"
  fi
done

port=29600
# on_all ENV -- ARGS: `tandem run` on every host (2 ranks each); prints host 0's output.
on_all() {
  local env=$1; shift
  port=$((port + 1))
  local pids=() out
  out=$(mktemp)
  for i in $(seq 0 $((hosts - 1))); do
    # shellcheck disable=SC2086
    ip netns exec "${id}h$i" unshare --uts sh -c "hostname simhost$i && exec env $env \"\$0\" \"\$@\"" \
      "$tandem" run --nnodes "$hosts" --node-rank "$i" --master-addr 10.78.0.1 \
      --master-port "$port" --nproc-per-node 2 -- "$@" > "$out.$i" 2>&1 &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  cat "$out.0"
  [ $rc = 0 ] || { echo "a host failed:" >&2; cat "$out".* >&2; exit 1; }
  rm -f "$out" "$out".*
}

stats() { sort -g | awk '{ v[NR] = $1 } END { printf "%.3f / %.3f / %.3f", v[1], v[int((NR + 1) / 2)], v[NR] }'; }

world=$((hosts * 2))
parts=${BENCH_PARTS:-all}
echo "### $hosts hosts x 2 ranks, $shaping"
if [ "$parts" != train ]; then
echo
echo "All-reduce (f32 sum), busbw = algbw x 2(n-1)/n with n = $world, GB/s min / median / max of $repeats runs:"
echo
echo "| size | flat TCP ring | hierarchical | hierarchical / flat (medians) |"
echo "|---|--:|--:|--:|"
for size in 16M 64M; do
  declare -A med=()
  row="| $size "
  for mode in flat hierarchical; do
    vals=()
    for _ in $(seq "$repeats"); do
      # One rank of `tandem bench allreduce` per process, its job as JSON (see
      # crates/tandem-bench/src/local_ranks.rs); rank 0 prints `RESULT {json}` per size.
      job="{\"sizes\":[$(( ${size%M} << 20 ))],\"ops\":[\"all_reduce\"],\"seconds_per_size\":2.0,\"warmup_seconds\":0.3}"
      line=$(on_all "TANDEM_ALLREDUCE=$mode" env "TANDEM_BENCH_JOB=$job" "$tandem" bench worker allreduce \
        | grep -o 'RESULT .*' | head -1)
      read -r bytes secs <<< "$(echo "$line" | sed -E 's/.*"bytes":([0-9]+).*"secs":([0-9.eE+-]+).*/\1 \2/')"
      vals+=("$(awk -v b="$bytes" -v s="$secs" -v n="$world" 'BEGIN { printf "%.4f", b / s / 1e9 * 2 * (n - 1) / n }')")
    done
    s=$(printf '%s\n' "${vals[@]}" | stats)
    med[$mode]=$(echo "$s" | awk -F' / ' '{ print $2 }')
    row+="| $s "
  done
  ratio=$(awk -v h="${med[hierarchical]}" -v f="${med[flat]}" 'BEGIN { printf "%.2fx", h / f }')
  echo "$row| $ratio |"
done
fi
[ "$parts" = allreduce ] && exit 0
# Training: a link slow enough for gradients to matter.
for i in $(seq 0 $((hosts - 1))); do
  if [ "${shaping#netem}" != "$shaping" ]; then
    ip netns exec "${id}h$i" tc qdisc change dev "eth$i" root netem delay 0.2ms rate "${train_rate}mbit"
  else
    ip netns exec "${id}h$i" tc qdisc change dev "eth$i" root tbf rate "${train_rate}mbit" burst 65536 latency 50ms
  fi
done
echo
echo "DDP training across the hosts on ${train_rate} Mbit/s links (\`tandem train --model mlp --hidden 2048 --epochs 5 --batch-size 64\`, digits: 153k parameters, 0.6 MB of f32 gradients per step), samples/s min / median / max of $repeats runs, and the last run's final eval loss and accuracy:"
echo
echo "| gradients on the wire | samples/s | eval loss (last run) | eval accuracy (last run) |"
echo "|---|--:|--:|--:|"
for hook in none fp16 bf16 powersgd; do
  vals=()
  last=""
  for _ in $(seq "$repeats"); do
    last=$(on_all "" "$tandem" train --model mlp --hidden 2048 --epochs 5 --batch-size 64 --comm-hook "$hook" \
      --out "$(mktemp -d)")
    vals+=("$(echo "$last" | grep 'final:' | grep -o 'samples_per_s=[0-9.]*' | cut -d= -f2)")
  done
  accuracy=$(echo "$last" | grep 'final:' | grep -o 'eval_accuracy=[0-9.]*' | cut -d= -f2)
  eval_loss=$(echo "$last" | grep -o 'eval_loss=[0-9.]*' | tail -1 | cut -d= -f2)
  s=$(printf '%s\n' "${vals[@]}" | sort -g | awk '{ v[NR] = $1 } END { printf "%.0f / %.0f / %.0f", v[1], v[int((NR + 1) / 2)], v[NR] }')
  name=$([ "$hook" = none ] && echo "f32 (no hook)" || echo "$hook (\`--comm-hook $hook\`)")
  echo "| $name | $s | $eval_loss | $accuracy |"
done
