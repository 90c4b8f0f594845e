#!/usr/bin/env bash
# Builds the peer baselines (not part of the main netdam CMake build):
#   bench/peers/build/gloo_bench   Gloo over TCP, forks its own ranks
#   bench/peers/build/mpi_bench    Open MPI, run under mpirun
# Usage: bench/peers/build.sh [--no-setup]   (setup.sh installs the packages)
# Rebuilds only when a source is newer than the binary.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${PEERS_BUILD_DIR:-$here/build}"
[[ "${1:-}" == "--no-setup" ]] || "$here/setup.sh"
mkdir -p "$out"

CXXFLAGS=(-std=c++20 -O3 -march=native -Wall -Wextra -Wno-unused-parameter)

stale() {  # stale BIN SRC...
  local bin="$1"; shift
  [[ -x "$bin" ]] || return 0
  local s
  for s in "$@"; do [[ "$s" -nt "$bin" ]] && return 0; done
  return 1
}

if stale "$out/gloo_bench" "$here/gloo_bench.cc" "$here/common.h" "$0"; then
  echo "peers/build: gloo_bench"
  g++ "${CXXFLAGS[@]}" -o "$out/gloo_bench" "$here/gloo_bench.cc" -lgloo -pthread
fi
if stale "$out/mpi_bench" "$here/mpi_bench.cc" "$here/common.h" "$0"; then
  echo "peers/build: mpi_bench"
  OMPI_CXX=g++ mpicxx "${CXXFLAGS[@]}" -o "$out/mpi_bench" "$here/mpi_bench.cc"
fi
