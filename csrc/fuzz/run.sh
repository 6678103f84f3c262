#!/usr/bin/env bash
# Builds the libFuzzer harnesses with clang (AddressSanitizer + UBSan, findings abort) and runs
# each for SECONDS (default 30) from its seed corpus, csrc/fuzz/corpus/<harness>/. New inputs go
# to a temporary copy: the repository's corpus changes only by hand (make_corpus.py). A finding
# exits non-zero and prints the input that triggered it (base64), to add to the corpus once fixed.
#   bash csrc/fuzz/run.sh [SECONDS]     FUZZ_BUILD_DIR=dir keeps the build between runs
set -euo pipefail
seconds=${1:-30}
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${FUZZ_BUILD_DIR:-}
if [ -z "$build" ]; then
  build=$(mktemp -d)
  trap 'rm -rf "$build"' EXIT
fi
CXX=${CXX:-clang++} cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DFLASHSTREAM_SANITIZE=ON -DFLASHSTREAM_BUILD_FUZZERS=ON >/dev/null
cmake --build "$build" --target fuzz_tar_scanner fuzz_grouping >/dev/null
status=0
for name in fuzz_tar_scanner fuzz_grouping; do
  work=$(mktemp -d)
  cp -r "$root/csrc/fuzz/corpus/$name/." "$work/"
  dict=()
  [ "$name" = fuzz_tar_scanner ] && dict=(-dict="$root/csrc/fuzz/tar.dict")
  if "$build/$name" "${dict[@]}" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -max_len=16384 -print_final_stats=1 -artifact_prefix="$work/" "$work" \
      >"$work.log" 2>&1; then
    echo "$name: $(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work.log" | grep -o '[0-9]*$') runs, no finding"
  else
    status=1
    echo "$name: FINDING"
    grep -v '^#[0-9]\|^\s*NEW_FUNC' "$work.log" | tail -n 40
    keep=${FUZZ_ARTIFACTS:-/tmp/flashstream-fuzz}
    mkdir -p "$keep"
    for crash in "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-*; do
      [ -e "$crash" ] || continue
      cp "$crash" "$keep/$name-$(basename "$crash")"
      echo "input kept as $keep/$name-$(basename "$crash"); replay: $build/$name FILE"
      [ "$(stat -c %s "$crash")" -le 2048 ] && { echo "(base64) $(base64 -w0 "$crash")"; }
    done
  fi
  rm -rf "$work" "$work.log"
done
exit $status
