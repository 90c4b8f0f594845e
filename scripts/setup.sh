#!/usr/bin/env bash
# Installs what netdam needs to build and test (Debian 12, as root).
# Idempotent and quick when everything is already there.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  clang libclang-rt-14-dev            # libFuzzer and sanitizer runtimes
  libgtest-dev libgmock-dev libbenchmark-dev
  libfmt-dev libspdlog-dev libcli11-dev libtomlplusplus-dev
  libhwy-dev
  libsqlite3-dev                      # netdam-mmu's state file
  prometheus-cpp-dev                  # --metrics (optional: NETDAM_METRICS)
  redis-server                        # the baseline of `netdam-bench pool` (tests do not need it)
  iproute2 procps python3              # python3: the demo's plain UDP pool client
  iputils-ping                         # tests/cluster: ping across the emulated cluster
  nftables                             # scripts/cluster.sh --loss: random loss with nft rules in the namespaces
  python3-dev pybind11-dev python3-numpy  # the netdam Python module (for /usr/bin/python3)
  python3-torch libtorch-dev           # the torch.distributed backend and optimizer offload
  python3-torchvision                  # real models (resnet18/50) for the DDP tests and bench/torch/ddp_models.py
  libopenblas0-pthread                 # the BLAS libtorch recommends; without it torch's matmuls run on
                                       # the reference BLAS (docs/TORCH.md, "DDP: netdam against gloo")
  tshark                               # tests/wireshark: decodes a capture with tools/wireshark/netdam.lua
  libns3-dev                            # netdam-sim, the packet-level simulation (docs/SIMULATION.md)
  python3-matplotlib                   # scripts/sim_plots.py (the simulation report's plots)
  python3-venv python3-setuptools python3-wheel  # pip install . into a venv (tests/install)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
