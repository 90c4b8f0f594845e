// load_dataset() and dataset_info(): a file or directory of fixed-size
// samples into a pool allocation, and its header back out.
#include <fmt/format.h>

#include <algorithm>
#include <fstream>

#include "core/endian.h"
#include "common/crc32c.h"
#include "dataset/format.h"
#include "dataset/pool_io.h"
#include "netdam/dataset.h"

namespace netdam {

namespace fs = std::filesystem;
using dataset::PoolIo;

namespace {

constexpr size_t kChunkBytes = 8u << 20;  // file bytes per write round

struct Source {
  fs::path path;
  uint64_t bytes = 0;
};

// The files to load, in order, each checked to be whole samples.
Result<std::vector<Source>> sources(const fs::path& source, uint64_t sample_size) {
  std::error_code ec;
  const auto st = fs::status(source, ec);
  if (ec || !fs::exists(st)) return Error::invalid(fmt::format("{}: no such file or directory", source.string()));
  std::vector<Source> out;
  if (fs::is_directory(st)) {
    for (const auto& e : fs::directory_iterator(source, ec))
      if (e.is_regular_file()) out.push_back({e.path(), 0});
    if (ec) return Error::invalid(fmt::format("{}: {}", source.string(), ec.message()));
    // Byte-wise name order: the same on every machine, whatever the locale.
    std::sort(out.begin(), out.end(),
              [](const Source& a, const Source& b) { return a.path.filename().string() < b.path.filename().string(); });
    if (out.empty()) return Error::invalid(fmt::format("{}: no regular files in the directory", source.string()));
  } else if (fs::is_regular_file(st)) {
    out.push_back({source, 0});
  } else {
    return Error::invalid(fmt::format("{}: not a regular file or a directory", source.string()));
  }
  for (auto& s : out) {
    s.bytes = fs::file_size(s.path, ec);
    if (ec) return Error::invalid(fmt::format("{}: {}", s.path.string(), ec.message()));
    if (s.bytes % sample_size != 0)
      return Error::invalid(fmt::format("{}: {} bytes is not a whole number of {}-byte samples ({} bytes left over)",
                                        s.path.string(), s.bytes, sample_size, s.bytes % sample_size));
    if (s.path.filename().string().size() > dataset::kMaxFileName)
      return Error::invalid(fmt::format("{}: file name longer than {} bytes", s.path.string(), dataset::kMaxFileName));
  }
  return out;
}

DatasetInfo to_info(std::string_view name, const dataset::Header& h, const PoolAllocation& a) {
  DatasetInfo i;
  i.name = std::string(name);
  i.version = h.version;
  i.sample_size = h.sample_size;
  i.sample_count = h.sample_count;
  i.data_offset = h.data_offset;
  i.sample_crc = h.flags & dataset::kFlagSampleCrc;
  for (const auto& f : h.files) i.files.push_back({f.name, f.first_sample, f.samples});
  i.allocation = a;
  return i;
}

// Everything after the allocation exists; the caller frees it on error.
Error store(Pool& pool, const PoolAllocation& a, dataset::Header& h, const std::vector<Source>& files,
            const DatasetLoadOptions& o) {
  auto io = PoolIo::open(pool, a, o.path);
  if (!io) return io.error();
  PoolIo& w = **io;
  // A reused extent may hold an old dataset's header: make offset 0 not a
  // dataset until the load is complete.
  std::vector<std::byte> zero(dataset::kFixedHeader);
  w.write(0, zero, 0);
  if (Error e = w.wait_all()) return e;

  const uint64_t ss = h.sample_size;
  const uint64_t per_chunk = std::max<uint64_t>(1, kChunkBytes / ss);
  std::vector<std::byte> buf(per_chunk * ss);
  std::vector<std::byte> crcs(4 * h.sample_count);
  const uint64_t total = h.sample_count * ss;
  uint64_t sample = 0;
  for (const auto& f : files) {
    std::ifstream in(f.path, std::ios::binary);
    if (!in) return Error::invalid(fmt::format("{}: cannot open", f.path.string()));
    for (uint64_t left = f.bytes / ss; left > 0;) {
      const uint64_t n = std::min(left, per_chunk);
      auto chunk = std::span(buf).first(n * ss);
      in.read(reinterpret_cast<char*>(chunk.data()), static_cast<std::streamsize>(chunk.size()));
      if (static_cast<uint64_t>(in.gcount()) != chunk.size())
        return Error::invalid(fmt::format("{}: short read (did the file change?)", f.path.string()));
      for (uint64_t i = 0; i < n; ++i)
        core::store_be<uint32_t>(crcs.data() + 4 * (sample + i), crc32c(chunk.subspan(i * ss, ss)));
      w.write(h.data_offset + sample * ss, chunk, 0);
      if (Error e = w.wait_all()) return e;
      sample += n;
      left -= n;
      if (o.progress) o.progress(sample * ss, total);
    }
  }
  w.write(h.crc_offset, crcs, 0);
  if (Error e = w.wait_all()) return e;
  const auto head = dataset::encode(h);
  w.write(0, head, 0);
  return w.wait_all();
}

}  // namespace

Result<DatasetInfo> load_dataset(Pool& pool, std::string_view name, const fs::path& source,
                                 const DatasetLoadOptions& o) {
  if (o.sample_size == 0) return Error::invalid("the sample size must be at least 1 byte");
  auto files = sources(source, o.sample_size);
  if (!files) return files.error();
  dataset::Header h;
  h.sample_size = o.sample_size;
  for (const auto& f : *files) {
    h.files.push_back({f.path.filename().string(), h.sample_count, f.bytes / o.sample_size});
    h.sample_count += f.bytes / o.sample_size;
  }
  if (h.sample_count == 0) return Error::invalid(fmt::format("{}: no samples (empty input)", source.string()));
  if (!dataset::plan_layout(h)) return Error::invalid("the dataset does not fit one pool allocation (1 TiB)");
  auto a = pool.alloc(name, h.total_size(), o.alloc);
  if (!a) {
    if (a.error().code() == Error::Code::kNak && a.error().status() == Status::kAlreadyExists)
      return Error::nak(Status::kAlreadyExists, fmt::format("the name '{}' is taken (pool ls lists it)", name));
    return a.error();
  }
  if (Error e = store(pool, *a, h, *files, o)) {
    (void)pool.free(name);  // best effort: the load failed, leave nothing half-made
    return e;
  }
  return to_info(name, h, *a);
}

Result<DatasetInfo> dataset_info(Pool& pool, std::string_view name) {
  auto a = pool.lookup(name);
  if (!a) return a.error();
  std::vector<std::byte> head(std::min<uint64_t>(a->size, dataset::kAlign));
  if (Error e = pool.get(a->base, head, a->key)) return e;
  auto size = dataset::header_size(head);
  if (size && *size > head.size()) {
    if (*size > a->size) return Error::protocol(fmt::format("'{}': dataset header longer than the allocation", name));
    head.resize(*size);
    if (Error e = pool.get(a->base, head, a->key)) return e;
  }
  auto h = dataset::decode(head);
  if (!h) return Error::protocol(fmt::format("'{}': {}", name, h.error().message()));
  if (h->total_size() > a->size) return Error::protocol(fmt::format("'{}': dataset larger than its allocation", name));
  return to_info(name, *h, *a);
}

}  // namespace netdam
