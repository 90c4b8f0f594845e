#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) in build-fuzz/ and
# runs each for FUZZ_SECONDS (default 60) on a copy of the seed corpus.
# Fails if a fuzzer finds a crash, a leak or an invariant violation; the
# reproducer is left in build-fuzz/fuzz-run/<target>/ (crash-*, leak-*, ...).
#
#   scripts/fuzz.sh                  # all targets, 60 s each
#   FUZZ_SECONDS=600 scripts/fuzz.sh engine_fuzz
#
# Environment: FUZZ_SECONDS, FUZZ_JOBS (parallel fuzzing processes per
# target, default 1), FUZZ_BUILD_DIR (default <repo>/build-fuzz), CXX_FUZZ
# (default clang++, else clang++-14).
# Reproduce a finding: build-fuzz/fuzz/engine_fuzz <crash file>
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${FUZZ_BUILD_DIR:-$root/build-fuzz}
seconds=${FUZZ_SECONDS:-60}
jobs=${FUZZ_JOBS:-1}
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(engine_fuzz wire_fuzz)

cxx=${CXX_FUZZ:-}
if [ -z "$cxx" ]; then
  for c in clang++ clang++-14; do
    if command -v "$c" >/dev/null; then cxx=$c; break; fi
  done
fi
[ -n "$cxx" ] || { echo "fuzz.sh: clang++ not found" >&2; exit 2; }

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DNETDAM_FUZZ=ON -DNETDAM_BENCH=OFF >/dev/null
ninja -C "$build" "${targets[@]}"

export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}

status=0
for t in "${targets[@]}"; do
  work=$build/fuzz-run/$t
  rm -rf "$work"
  mkdir -p "$work/corpus"
  # Both targets take "control byte + datagram" inputs and share the seeds.
  cp "$root"/fuzz/corpus/engine/* "$work/corpus/" 2>/dev/null || true
  echo "== $t: ${seconds}s, $jobs job(s), corpus $(ls "$work/corpus" | wc -l) files"
  parallel=()
  [ "$jobs" -gt 1 ] && parallel=(-jobs="$jobs" -workers="$jobs")
  set +e
  (cd "$work" && "$build/fuzz/$t" -max_total_time="$seconds" -print_final_stats=1 \
     -timeout=10 -rss_limit_mb=2048 -max_len=9000 -artifact_prefix="$work/" \
     "${parallel[@]}" corpus >"$work/log.txt" 2>&1)
  rc=$?
  set -e
  # With -jobs each job logs to fuzz-N.log in $work.
  for f in "$work"/fuzz-*.log; do [ -f "$f" ] && cat "$f" >>"$work/log.txt"; done
  grep -E "^(#[0-9]+ *(INITED|DONE)|stat::number_of_executed_units|==[0-9]+==ERROR|SUMMARY|.*invariant failed|.*runtime error|Test unit written)" \
    "$work/log.txt" || true
  artifacts=$(find "$work" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'leak-*' \
                -o -name 'timeout-*' -o -name 'oom-*' \) | sort)
  if [ "$rc" -ne 0 ] || [ -n "$artifacts" ]; then
    echo "!! $t failed (exit $rc); see $work/log.txt" >&2
    [ -n "$artifacts" ] && echo "$artifacts" >&2
    status=1
  else
    echo "== $t: no crash"
  fi
done
exit $status
