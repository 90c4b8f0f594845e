#include "netdam/local_memory.h"

#include "common/mapping.h"

namespace netdam {

LocalMemory::LocalMemory(std::unique_ptr<Mapping> m) : mapping_(std::move(m)) {}
LocalMemory::~LocalMemory() = default;

Result<std::unique_ptr<LocalMemory>> LocalMemory::open(std::string_view shm_name) {
  auto m = Mapping::open_shared(std::string(shm_name));
  if (!m) return m.error();  // kTransport
  return std::unique_ptr<LocalMemory>(new LocalMemory(std::move(*m)));
}

std::span<std::byte> LocalMemory::bytes() const { return mapping_->bytes(); }

}  // namespace netdam
