// A consumer of the installed netdam (tests/install/install_test.sh): it
// includes every public header, so one that needs a private header fails to
// compile here, and it calls into each exported library, so an archive
// missing from the package or its link dependencies fails to link.
//
// consumer HOST:PORT talks to a running netdamd: PING, a WRITE read back,
// a FETCH_ADD. Prints "consumer ok" and exits 0 when all is as expected.
#include <netdam/client.h>
#include <netdam/dataset.h>
#include <netdam/error.h>
#include <netdam/group.h>
#include <netdam/local_memory.h>
#include <netdam/optimizer.h>
#include <netdam/pool.h>
#include <netdam/types.h>

#include <cstdio>
#include <cstring>
#include <vector>

namespace {

int fail(const char* what, const netdam::Error& e) {
  std::fprintf(stderr, "consumer: %s: %s\n", what, e.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer HOST:PORT\n");
    return 2;
  }
  auto client = netdam::Client::connect(argv[1]);
  if (!client) return fail("connect", client.error());
  auto info = (*client)->ping();
  if (!info) return fail("ping", info.error());

  std::vector<std::byte> out(4096), in(out.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::byte>(i * 7 + 3);
  if (auto e = (*client)->write(0x1000, out)) return fail("write", e);
  if (auto e = (*client)->read(0x1000, in)) return fail("read", e);
  if (std::memcmp(out.data(), in.data(), out.size()) != 0) {
    std::fprintf(stderr, "consumer: read back differs from what was written\n");
    return 1;
  }
  auto before = (*client)->fetch_add(0x8000, 5);
  auto after = (*client)->fetch_add(0x8000, 0);
  if (!before) return fail("fetch_add", before.error());
  if (!after) return fail("fetch_add", after.error());
  if (*after != *before + 5) {
    std::fprintf(stderr, "consumer: fetch_add: %llu then %llu\n", static_cast<unsigned long long>(*before),
                 static_cast<unsigned long long>(*after));
    return 1;
  }

  // Pure functions of the other libraries: they need no pool or group.
  netdam::GroupOptions group;
  group.devices = {argv[1]};
  const uint64_t group_bytes = netdam::Group::device_bytes(group, info->max_payload);
  const size_t shard = netdam::shard(10, 0, 1, 0, 2).size();
  auto connect_pool = &netdam::Pool::connect;  // links the pool library
  if (group_bytes == 0 || shard != 5 || connect_pool == nullptr) {
    std::fprintf(stderr, "consumer: group bytes %llu, shard of 10 over 2: %zu\n",
                 static_cast<unsigned long long>(group_bytes), shard);
    return 1;
  }
  std::printf("consumer ok: device of %llu bytes, %s, 4096 bytes written and read back\n",
              static_cast<unsigned long long>(info->memory_bytes),
              std::string(netdam::to_string(netdam::Opcode::kWrite)).c_str());
  return 0;
}
