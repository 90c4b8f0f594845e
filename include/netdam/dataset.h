// Training data in a NetDAM memory pool (docs/POOL.md, "Training data in
// the pool").
//
// A dataset is one pool allocation holding a header (sample size, count,
// format version, the source files), a CRC32C per sample, and the samples
// back to back; a reader needs only its name. Samples are fixed-size.
//
// Contract
// - load_dataset() stores a file of samples, or every regular file of a
//   directory in sorted name order (each a whole number of samples), as the
//   allocation NAME. Bad input (sample size not dividing a file, missing
//   file, no samples, name taken) fails before any data is sent; a load that
//   fails later frees the allocation. The header is written last.
// - EpochPermutation is a bijection of [0, n) fixed by (seed, epoch): the
//   same on every machine and standard library (a 6-round Feistel network
//   over SplitMix64, with cycle walking; the exact recipe is in POOL.md).
// - shard() gives worker `rank` of `world` the positions rank, rank + world,
//   rank + 2*world, ... of the epoch's permutation. Remainder says what
//   happens when world does not divide n (see below).
// - DatasetReader::read_batch() reads samples by index with many READs in
//   flight (straight to the devices by default), and checks each sample's
//   CRC32C unless told not to.
//
// Threading: a DatasetReader is not thread-safe; use one per thread (each
// opens its own sockets). The Pool passed to open() must outlive it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "netdam/error.h"
#include "netdam/pool.h"

namespace netdam {

namespace dataset {
class PoolIo;
}

struct DatasetFile {
  std::string name;  // base name of the source file
  uint64_t first_sample = 0, samples = 0;
};

struct DatasetInfo {
  std::string name;
  uint32_t version = 0;
  uint64_t sample_size = 0, sample_count = 0;
  uint64_t data_offset = 0;  // allocation offset of sample 0
  bool sample_crc = false;   // a CRC32C per sample is stored
  std::vector<DatasetFile> files;
  PoolAllocation allocation;
};

struct DatasetLoadOptions {
  uint64_t sample_size = 0;  // required
  AllocOptions alloc;        // stripe, policy, devices of the allocation
  Pool::Path path = Pool::Path::kDirect;
  // Called after each chunk with (bytes stored, total bytes).
  std::function<void(uint64_t, uint64_t)> progress;
};

// Stores `source` (a file, or a directory's regular files) as dataset `name`.
Result<DatasetInfo> load_dataset(Pool& pool, std::string_view name, const std::filesystem::path& source,
                                 const DatasetLoadOptions& o);
// Reads a dataset's header (proxy path).
Result<DatasetInfo> dataset_info(Pool& pool, std::string_view name);

// A seeded random permutation of [0, n), one per (seed, epoch).
class EpochPermutation {
 public:
  EpochPermutation(uint64_t n, uint64_t seed, uint64_t epoch);
  uint64_t size() const { return n_; }
  // The sample at position i (i < n).
  uint64_t operator()(uint64_t i) const;

 private:
  static constexpr int kRounds = 6;
  uint64_t feistel(uint64_t x) const;
  uint64_t n_;
  unsigned half_bits_ = 0;
  uint64_t half_mask_ = 0;
  uint64_t keys_[kRounds] = {};
};

// When world does not divide n:
//   kPad      every worker gets ceil(n / world) samples; the positions past
//             n wrap around to the epoch's first samples, so each sample is
//             read once and the first (ceil * world - n) of the epoch twice.
//             Equal steps for every worker (like PyTorch's DistributedSampler).
//   kDropLast every worker gets floor(n / world); the epoch's last n mod world
//             positions are skipped (different samples every epoch).
//   kUneven   exactly once: the first n mod world ranks get one more.
enum class Remainder : uint8_t { kPad, kDropLast, kUneven };

// Worker `rank`'s sample indices for `epoch`, in the order to read them.
std::vector<uint64_t> shard(uint64_t n, uint64_t epoch, uint64_t seed, uint32_t rank, uint32_t world,
                            Remainder r = Remainder::kPad);

class DatasetReader {
 public:
  struct Options {
    Pool::Path path = Pool::Path::kDirect;
    bool verify = true;  // check every sample's CRC32C
    ClientOptions client;  // window and timeout of the data clients (rkey is the allocation's)
  };
  static Result<std::unique_ptr<DatasetReader>> open(Pool& pool, std::string_view name, Options o);
  static Result<std::unique_ptr<DatasetReader>> open(Pool& pool, std::string_view name) {
    return open(pool, name, Options{});
  }
  ~DatasetReader();
  DatasetReader(const DatasetReader&) = delete;
  DatasetReader& operator=(const DatasetReader&) = delete;

  const DatasetInfo& info() const { return info_; }
  uint64_t size() const { return info_.sample_count; }
  uint64_t sample_size() const { return info_.sample_size; }

  std::vector<uint64_t> shard(uint64_t epoch, uint64_t seed, uint32_t rank, uint32_t world,
                              Remainder r = Remainder::kPad) const {
    return netdam::shard(info_.sample_count, epoch, seed, rank, world, r);
  }

  // Reads samples indices[i] into out[i * sample_size, ...): all READs are
  // started at once (each client windows them) and then awaited.
  // out.size() must be indices.size() * sample_size. A sample whose
  // checksum does not match fails the batch (kProtocol, naming it).
  Error read_batch(std::span<const uint64_t> indices, std::span<std::byte> out);

 private:
  DatasetReader(Pool& pool, DatasetInfo info, Options o);
  Pool& pool_;
  DatasetInfo info_;
  Options opts_;
  std::vector<uint32_t> crcs_;
  std::unique_ptr<dataset::PoolIo> io_;  // reopened after an error
};

}  // namespace netdam
