#!/usr/bin/env bash
# `pip install .` as a user does it, into a fresh venv of Debian's python3:
#   pip_install_test.sh BUILD_DIR
# installs this source tree with pip (setup.py reusing BUILD_DIR through
# NETDAM_CMAKE_BUILD_DIR: the files still go through a wheel into the
# venv, only the compiling is saved), then, from another directory and
# without PYTHONPATH, imports netdam, starts a device with the netdamd the
# package installed and writes and reads it; runs the commands pip put on
# the venv's PATH; imports the torch backend if there is one.
# Exit 77 (CTest: skipped) where a venv with pip cannot be made.
set -euo pipefail

build=$(cd "${1:?usage: pip_install_test.sh BUILD_DIR}" && pwd)
source_dir=$(cd "$(dirname "$0")/../.." && pwd)
python=/usr/bin/python3

tmp=$(mktemp -d /tmp/netdam-pip-test.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() {
  echo "pip_install_test: FAILED: $*" >&2
  exit 1
}

echo "== $python -m venv --system-site-packages"
if ! "$python" -m venv --system-site-packages "$tmp/venv" >"$tmp/venv.log" 2>&1; then
  cat "$tmp/venv.log" >&2
  echo "pip_install_test: skipped: no venv with pip (Debian: python3-venv)" >&2
  exit 77
fi
venv_python=$tmp/venv/bin/python

echo "== pip install --no-build-isolation $source_dir (NETDAM_CMAKE_BUILD_DIR=$build)"
# --no-index: everything comes from Debian (setuptools, wheel); nothing is
# fetched.
(cd "$source_dir" && env -u PYTHONPATH NETDAM_CMAKE_BUILD_DIR="$build" \
  "$venv_python" -m pip install --no-build-isolation --no-index --disable-pip-version-check -q .) \
  >"$tmp/pip.log" 2>&1 || { cat "$tmp/pip.log"; fail "pip install"; }

echo "== import netdam from the venv, start a device, write and read"
cd "$tmp"
env -u PYTHONPATH -u NETDAMD -u NETDAM_MMU -u NETDAM_DAEMON PYTHONDONTWRITEBYTECODE=1 "$venv_python" - "$tmp/venv" <<'EOF' || fail "the installed package"
import os
import sys

venv = os.path.realpath(sys.argv[1])
import netdam
import netdam.local

def inside(path):
    return os.path.realpath(path).startswith(venv + os.sep)

assert inside(netdam.__file__), f"netdam imported from {netdam.__file__}, not from the venv"
for daemon in (netdam.local.netdamd_path(), netdam.local.mmu_path()):
    assert inside(daemon) and os.access(daemon, os.X_OK), f"daemon not installed in the venv: {daemon}"

data = bytes(range(256)) * 64
with netdam.local.Device(memory="4MiB") as dev:
    c = netdam.Client(dev.endpoint)
    c.write(0x1000, data)
    assert c.read(0x1000, len(data)) == data, "read back differs"
    assert c.fetch_add(0x8000, 7) == 0 and c.fetch_add(0x8000, 0) == 7, "fetch_add"
    c.close()
print(f"netdam {netdam.__version__} from {os.path.dirname(netdam.__file__)}: "
      f"{len(data)} bytes written and read back through {os.path.basename(netdam.local.netdamd_path())}")
EOF

# The commands on the venv's PATH run the package's executables.
version=$(env -u PYTHONPATH PATH="$tmp/venv/bin:$PATH" netdam --version) || fail "netdam --version"
[[ $version == "netdam $(env -u PYTHONPATH "$venv_python" -c 'import netdam; print(netdam.__version__)') (wire protocol 1)" ]] ||
  fail "netdam --version printed '$version'"
env -u PYTHONPATH PATH="$tmp/venv/bin:$PATH" netdamd --help >/dev/null || fail "netdamd --help"
# The license travels with the package.
env -u PYTHONPATH "$venv_python" -c 'import importlib.metadata as m; assert m.metadata("netdam")["License"] == "Apache-2.0", m.metadata("netdam")["License"]' ||
  fail "the package's metadata does not name its license"
env -u PYTHONPATH PATH="$tmp/venv/bin:$PATH" netdam-mmu --help >/dev/null || fail "netdam-mmu --help"
echo "commands: $version; netdamd, netdam-mmu"

# The torch backend, when this build has it: it loads against Debian's torch.
if [[ -n $(find "$tmp/venv" -name '_torch_backend*.so' -print -quit) ]]; then
  env -u PYTHONPATH "$venv_python" -c 'import torch, netdam.distributed, netdam._torch_backend' ||
    fail "the installed torch backend does not import"
  echo "torch backend: imports"
fi
echo "pip_install_test: passed"
