#!/usr/bin/env bash
# Sets everything up and runs the whole test suite: unit and integration
# tests, the same tests under ASan+UBSan, and a short fuzz run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
jobs=$(nproc)

echo "== build and test (RelWithDebInfo)"
BUILD_DIR=build bash scripts/build.sh
(cd build && ctest --output-on-failure -j "$jobs" --timeout 600)

echo "== build and test under AddressSanitizer + UndefinedBehaviorSanitizer"
BUILD_DIR=build-asan BUILD_TYPE=Debug bash scripts/build.sh -DNETDAM_SANITIZE=ON -DNETDAM_BENCH=OFF
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
   ctest --output-on-failure -j "$jobs" --timeout 900)

if [[ -f scripts/fuzz.sh ]]; then
  echo "== short fuzz run"
  FUZZ_SECONDS=${FUZZ_SECONDS:-30} bash scripts/fuzz.sh
fi
echo "== all tests passed"
