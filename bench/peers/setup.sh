#!/usr/bin/env bash
# Installs what the peer baselines (Gloo, Open MPI) need (Debian 12, as root).
# Idempotent: checks with dpkg-query first; runs apt-get update only if
# something is missing. Not part of the main build: netdam never depends on it.
set -euo pipefail

packages=(
  g++ make
  libgloo-dev                        # Gloo headers + libgloo.so (TCP transport)
  openmpi-bin libopenmpi-dev         # mpirun, mpicc/mpicxx, libmpi
  python3                            # table merge in scripts/compare_peers.sh
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "peers/setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
