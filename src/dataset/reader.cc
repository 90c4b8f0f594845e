// DatasetReader: samples by index, many READs in flight, checksummed.
#include <fmt/format.h>

#include "core/endian.h"
#include "common/crc32c.h"
#include "dataset/format.h"
#include "dataset/pool_io.h"
#include "netdam/dataset.h"

namespace netdam {

DatasetReader::DatasetReader(Pool& pool, DatasetInfo info, Options o)
    : pool_(pool), info_(std::move(info)), opts_(o) {}
DatasetReader::~DatasetReader() = default;

Result<std::unique_ptr<DatasetReader>> DatasetReader::open(Pool& pool, std::string_view name, Options o) {
  auto info = dataset_info(pool, name);
  if (!info) return info.error();
  std::unique_ptr<DatasetReader> r(new DatasetReader(pool, std::move(*info), o));
  if (o.verify && r->info_.sample_crc) {
    dataset::Header h;  // only for the table's offset
    h.sample_size = r->info_.sample_size;
    h.sample_count = r->info_.sample_count;
    for (const auto& f : r->info_.files) h.files.push_back({f.name, f.first_sample, f.samples});
    dataset::plan_layout(h);
    std::vector<std::byte> table(4 * h.sample_count);
    const PoolAllocation& a = r->info_.allocation;
    if (Error e = pool.get(a.base + h.crc_offset, table, a.key, o.path)) return e;
    r->crcs_.resize(h.sample_count);
    for (uint64_t i = 0; i < h.sample_count; ++i) r->crcs_[i] = core::load_be<uint32_t>(table.data() + 4 * i);
  }
  auto io = dataset::PoolIo::open(pool, r->info_.allocation, o.path, o.client);
  if (!io) return io.error();
  r->io_ = std::move(*io);
  return r;
}

Error DatasetReader::read_batch(std::span<const uint64_t> indices, std::span<std::byte> out) {
  const uint64_t ss = info_.sample_size;
  if (out.size() / ss != indices.size() || out.size() % ss != 0)
    return Error::invalid(fmt::format("read_batch: {} samples need {} bytes, the buffer has {}", indices.size(),
                                      indices.size() * ss, out.size()));
  for (uint64_t idx : indices)
    if (idx >= info_.sample_count)
      return Error::invalid(fmt::format("read_batch: sample {} of a {}-sample dataset", idx, info_.sample_count));
  if (!io_) {  // an earlier batch failed: fetch the translation table again
    auto io = dataset::PoolIo::open(pool_, info_.allocation, opts_.path, opts_.client);
    if (!io) return io.error();
    io_ = std::move(*io);
  }
  for (size_t i = 0; i < indices.size(); ++i) io_->read(info_.data_offset + indices[i] * ss, out.subspan(i * ss, ss), i);
  if (Error e = io_->wait_all()) {
    io_.reset();
    return e;
  }
  if (!crcs_.empty())
    for (size_t i = 0; i < indices.size(); ++i)
      if (crc32c(out.subspan(i * ss, ss)) != crcs_[indices[i]])
        return Error::protocol(fmt::format("dataset '{}': sample {} does not match its checksum", info_.name, indices[i]));
  return {};
}

}  // namespace netdam
