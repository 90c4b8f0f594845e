#!/usr/bin/env bash
# The installed package, used as a project outside the tree would use it:
#   install_test.sh BUILD_DIR
# installs BUILD_DIR (already built: install only copies) into a temporary
# prefix, checks what is there and what is not (src/'s private headers, paths
# into the source or build tree), starts the installed netdamd, and builds
# and runs tests/install/consumer twice against the prefix: with CMake's
# find_package(netdam) and with g++ $(pkg-config --cflags --libs netdam).
# Exit 77 (CTest: skipped) where a tool it needs is missing.
set -euo pipefail

build=$(cd "${1:?usage: install_test.sh BUILD_DIR}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
source_dir=$(cd "$here/../.." && pwd)
for tool in cmake g++ pkg-config; do
  if ! command -v "$tool" >/dev/null; then
    echo "install_test: skipped: $tool is not installed" >&2
    exit 77
  fi
done

tmp=$(mktemp -d /tmp/netdam-install-test.XXXXXX)
daemon=""
cleanup() {
  if [[ -n $daemon ]]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "install_test: FAILED: $*" >&2
  exit 1
}

prefix=$tmp/prefix
echo "== cmake --install $build --prefix $prefix"
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; fail "cmake --install"; }

echo "== what is installed"
[[ -x $prefix/bin/netdamd && -x $prefix/bin/netdam && -x $prefix/bin/netdam-mmu ]] || fail "executables missing in $prefix/bin"
# Exactly the public headers (and the generated version.h): nothing of
# src/, nothing left out.
diff <( (cd "$source_dir/include" && find . -type f; echo ./netdam/version.h) | sort) \
  <(cd "$prefix/include" && find . -type f | sort) ||
  fail "installed headers differ from include/ (above: < only in include/, > only installed)"
[[ -f $prefix/share/doc/netdam/LICENSE ]] || fail "LICENSE not installed in share/doc/netdam"
[[ $("$prefix/bin/netdamd" --version) == "netdamd "* ]] || fail "netdamd --version"
config=$(find "$prefix" -name netdamConfig.cmake)
pc=$(find "$prefix" -name netdam.pc)
[[ -n $config && -f $(dirname "$config")/netdamConfigVersion.cmake ]] || fail "no netdamConfig.cmake + version file"
[[ -n $pc ]] || fail "no netdam.pc"
for lib in client collectives pool pool_core dataset core transport common; do
  [[ -n $(find "$prefix" -name "libnetdam_$lib.a") ]] || fail "libnetdam_$lib.a not installed"
done
# A consumer must not depend on where netdam was built.
if grep -rlF -e "$source_dir" -e "$build" "$(dirname "$config")" "$pc"; then
  fail "the files above name the source or build tree"
fi

echo "== the installed netdamd"
"$prefix/bin/netdamd" --listen 127.0.0.1:0 --port-file "$tmp/port" --memory 16MiB >"$tmp/netdamd.log" 2>&1 &
daemon=$!
for _ in $(seq 1 200); do
  [[ -s $tmp/port ]] && break
  kill -0 "$daemon" 2>/dev/null || { cat "$tmp/netdamd.log"; fail "netdamd exited"; }
  sleep 0.05
done
[[ -s $tmp/port ]] || { cat "$tmp/netdamd.log"; fail "netdamd wrote no port file within 10 s"; }
endpoint=$(<"$tmp/port")
NETDAM_DEVICE=$endpoint "$prefix/bin/netdam" ping || fail "the installed netdam CLI cannot ping $endpoint"

run_consumer() {  # NAME EXECUTABLE
  local out
  out=$("$2" "$endpoint") || fail "$1 consumer: exit $? ($out)"
  echo "$1: $out"
  [[ $out == "consumer ok: device of 16777216 bytes, WRITE, 4096 bytes written and read back" ]] ||
    fail "$1 consumer printed something else"
}

echo "== consumer with find_package(netdam)"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$here/consumer" -B "$tmp/consumer-cmake" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/consumer-cmake.log" 2>&1 || { cat "$tmp/consumer-cmake.log"; fail "configuring the consumer"; }
cmake --build "$tmp/consumer-cmake" >>"$tmp/consumer-cmake.log" 2>&1 || { cat "$tmp/consumer-cmake.log"; fail "building the consumer"; }
run_consumer find_package "$tmp/consumer-cmake/consumer"

echo "== consumer with pkg-config"
# C++20 is the consumer's choice here (the headers need it, netdam.pc does
# not force a -std on anyone).
flags=$(PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --cflags --libs netdam) || fail "pkg-config --cflags --libs netdam"
echo "pkg-config: $flags"
# shellcheck disable=SC2086  # the flags are words
g++ -std=c++20 -O1 -o "$tmp/consumer-pc" "$here/consumer/main.cc" $flags || fail "g++ with pkg-config's flags"
run_consumer pkg-config "$tmp/consumer-pc"

echo "install_test: passed"
