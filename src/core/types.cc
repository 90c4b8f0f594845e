#include "netdam/types.h"

#include <array>

namespace netdam {

std::string_view to_string(Opcode op) {
  switch (op) {
    case Opcode::kPing: return "PING";
    case Opcode::kStats: return "STATS";
    case Opcode::kRead: return "READ";
    case Opcode::kWrite: return "WRITE";
    case Opcode::kFill: return "FILL";
    case Opcode::kCopy: return "COPY";
    case Opcode::kArm: return "ARM";
    case Opcode::kFetchAdd: return "FETCH_ADD";
    case Opcode::kCompareSwap: return "COMPARE_SWAP";
    case Opcode::kSwap: return "SWAP";
    case Opcode::kReduceMem: return "REDUCE_MEM";
    case Opcode::kReducePayload: return "REDUCE_PAYLOAD";
    case Opcode::kOptConfig: return "OPT_CONFIG";
    case Opcode::kOptStep: return "OPT_STEP";
    case Opcode::kAggregate: return "AGGREGATE";
    case Opcode::kChain: return "CHAIN";
    case Opcode::kRegionAdd: return "REGION_ADD";
    case Opcode::kRegionDel: return "REGION_DEL";
    case Opcode::kRegionList: return "REGION_LIST";
    case Opcode::kPoolAlloc: return "POOL_ALLOC";
    case Opcode::kPoolFree: return "POOL_FREE";
    case Opcode::kPoolLookup: return "POOL_LOOKUP";
    case Opcode::kPoolList: return "POOL_LIST";
    case Opcode::kPoolMap: return "POOL_MAP";
    case Opcode::kPoolStat: return "POOL_STAT";
  }
  return "UNKNOWN_OPCODE";
}

bool is_valid_opcode(uint8_t v) { return to_string(static_cast<Opcode>(v)) != "UNKNOWN_OPCODE"; }

std::string_view to_string(Status s) {
  switch (s) {
    case Status::kOk: return "OK";
    case Status::kBadVersion: return "BAD_VERSION";
    case Status::kBadOpcode: return "BAD_OPCODE";
    case Status::kBadType: return "BAD_TYPE";
    case Status::kBadRedop: return "BAD_REDOP";
    case Status::kBadLength: return "BAD_LENGTH";
    case Status::kBadKey: return "BAD_KEY";
    case Status::kOutOfBounds: return "OUT_OF_BOUNDS";
    case Status::kMisaligned: return "MISALIGNED";
    case Status::kBadSegment: return "BAD_SEGMENT";
    case Status::kNotPermitted: return "NOT_PERMITTED";
    case Status::kBootMismatch: return "BOOT_MISMATCH";
    case Status::kStaleTxn: return "STALE_TXN";
    case Status::kNoSpace: return "NO_SPACE";
    case Status::kBadPayload: return "BAD_PAYLOAD";
    case Status::kBadFlags: return "BAD_FLAGS";
    case Status::kNotReady: return "NOT_READY";
    case Status::kStaleGeneration: return "STALE_GENERATION";
    case Status::kNoSuchAllocation: return "NO_SUCH_ALLOCATION";
    case Status::kDeviceLost: return "DEVICE_LOST";
    case Status::kUnavailable: return "UNAVAILABLE";
    case Status::kAlreadyExists: return "ALREADY_EXISTS";
    case Status::kNoOptimizer: return "NO_OPTIMIZER";
    case Status::kTxnAhead: return "TXN_AHEAD";
    case Status::kNotValidated: return "NOT_VALIDATED";
  }
  return "UNKNOWN_STATUS";
}

namespace {
constexpr std::array<std::string_view, kDTypeCount> kDTypeNames = {"bytes", "f32",  "f16", "bf16",
                                                                   "f64",   "i32",  "i64"};
constexpr std::array<std::string_view, kRedOpCount> kRedOpNames = {"none", "sum", "min", "max"};
}  // namespace

std::string_view to_string(DType t) {
  auto i = static_cast<uint8_t>(t);
  return i < kDTypeNames.size() ? kDTypeNames[i] : "unknown_type";
}

std::string_view to_string(RedOp r) {
  auto i = static_cast<uint8_t>(r);
  return i < kRedOpNames.size() ? kRedOpNames[i] : "unknown_redop";
}

std::optional<DType> parse_dtype(std::string_view name) {
  for (size_t i = 0; i < kDTypeNames.size(); ++i)
    if (kDTypeNames[i] == name) return static_cast<DType>(i);
  if (name == "float32" || name == "float") return DType::kF32;
  if (name == "float16" || name == "half") return DType::kF16;
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float64" || name == "double") return DType::kF64;
  if (name == "int32") return DType::kI32;
  if (name == "int64") return DType::kI64;
  return std::nullopt;
}

std::optional<RedOp> parse_redop(std::string_view name) {
  for (size_t i = 1; i < kRedOpNames.size(); ++i)
    if (kRedOpNames[i] == name) return static_cast<RedOp>(i);
  return std::nullopt;
}

}  // namespace netdam
