// Throughput of the reduction kernels: SIMD (dynamic dispatch) vs the scalar
// reference, for the element types and payload sizes the device sees (2048
// elements = one 8 KiB jumbo payload of f32, up to 16384 elements).
//
// bytes_per_second counts the bytes of dst reduced (n * element size) per
// call; memory traffic is three times that (read dst, read src, write dst).
// Before timing, each case checks once that the SIMD result equals the
// reference bit for bit, and aborts otherwise.
//
// --target=NAME (e.g. --target=AVX2) restricts the dispatch to one Highway
// target, to compare targets on one machine.
//
// BM_NaiveF32Sum is a plain loop with auto-vectorisation disabled (GCC), the
// baseline a "just write the loop" implementation would give.

#include <benchmark/benchmark.h>
#include <hwy/targets.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string_view>
#include <vector>

#include "core/reduce.h"

namespace netdam::core {
namespace {

struct Buffers {
  std::vector<std::byte> dst, src;
};

// Finite values in [-1, 1] (bit patterns of the type), so that the repeated
// in-place sums stay in the normal range for a long time.
Buffers MakeBuffers(DType t, size_t n) {
  const size_t es = dtype_size(t);
  Buffers b{std::vector<std::byte>(n * es), std::vector<std::byte>(n * es)};
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (auto* v : {&b.dst, &b.src}) {
    for (size_t i = 0; i < n; ++i) {
      const float f = dist(rng);
      std::byte* p = v->data() + i * es;
      switch (t) {
        case DType::kF32:
          std::memcpy(p, &f, 4);
          break;
        case DType::kF64: {
          const double d = f;
          std::memcpy(p, &d, 8);
          break;
        }
        case DType::kF16: {
          uint32_t bits;
          std::memcpy(&bits, &f, 4);
          const uint16_t h = f32_bits_to_f16_bits(bits);
          std::memcpy(p, &h, 2);
          break;
        }
        case DType::kBF16: {
          uint32_t bits;
          std::memcpy(&bits, &f, 4);
          const uint16_t h = f32_bits_to_bf16_bits(bits);
          std::memcpy(p, &h, 2);
          break;
        }
        case DType::kI32: {
          const int32_t x = static_cast<int32_t>(f * 1e6f);
          std::memcpy(p, &x, 4);
          break;
        }
        case DType::kI64: {
          const int64_t x = static_cast<int64_t>(f * 1e6f);
          std::memcpy(p, &x, 8);
          break;
        }
        case DType::kBytes:
          break;
      }
    }
  }
  return b;
}

void VerifyOnce(DType t, RedOp op, const Buffers& b, size_t n) {
  std::vector<std::byte> simd = b.dst, ref = b.dst;
  reduce_inplace(t, op, simd.data(), b.src.data(), n);
  reduce_reference(t, op, ref.data(), b.src.data(), n);
  if (simd != ref) {
    std::fprintf(stderr,
                 "reduce_bench: SIMD result differs from reference (dtype %d op %d n %zu)\n",
                 static_cast<int>(t), static_cast<int>(op), n);
    std::abort();
  }
}

template <bool kSimd>
void RunReduce(benchmark::State& state, DType t, RedOp op) {
  const auto n = static_cast<size_t>(state.range(0));
  Buffers b = MakeBuffers(t, n);
  VerifyOnce(t, op, b, n);
  for (auto _ : state) {
    if constexpr (kSimd) {
      reduce_inplace(t, op, b.dst.data(), b.src.data(), n);
    } else {
      reduce_reference(t, op, b.dst.data(), b.src.data(), n);
    }
    benchmark::DoNotOptimize(b.dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(n * dtype_size(t)));
  state.SetLabel(kSimd ? std::string(reduce_target_name()) : std::string("reference"));
}

void BM_Simd(benchmark::State& state, DType t, RedOp op) { RunReduce<true>(state, t, op); }
void BM_Reference(benchmark::State& state, DType t, RedOp op) { RunReduce<false>(state, t, op); }

#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-vectorize")))
#endif
void NaiveF32Sum(float* __restrict dst, const float* __restrict src, size_t n) {
#if defined(__clang__)
#pragma clang loop vectorize(disable) interleave(disable)
#endif
  for (size_t i = 0; i < n; ++i) dst[i] = dst[i] + src[i];
}

void BM_NaiveF32Sum(benchmark::State& state) {
  const auto n = static_cast<size_t>(state.range(0));
  std::vector<float> dst(n, 0.5f), src(n, 0.25f);
  for (auto _ : state) {
    NaiveF32Sum(dst.data(), src.data(), n);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(n * sizeof(float)));
}

#define NETDAM_REDUCE_BENCH(name, dtype, op)                          \
  BENCHMARK_CAPTURE(BM_Simd, name, dtype, op)->Arg(2048)->Arg(16384); \
  BENCHMARK_CAPTURE(BM_Reference, name, dtype, op)->Arg(2048)->Arg(16384)

NETDAM_REDUCE_BENCH(f32_sum, DType::kF32, RedOp::kSum);
NETDAM_REDUCE_BENCH(f16_sum, DType::kF16, RedOp::kSum);
NETDAM_REDUCE_BENCH(bf16_sum, DType::kBF16, RedOp::kSum);
NETDAM_REDUCE_BENCH(f64_sum, DType::kF64, RedOp::kSum);
NETDAM_REDUCE_BENCH(i32_sum, DType::kI32, RedOp::kSum);
NETDAM_REDUCE_BENCH(f32_max, DType::kF32, RedOp::kMax);
BENCHMARK(BM_NaiveF32Sum)->Arg(2048)->Arg(16384);

}  // namespace
}  // namespace netdam::core

int main(int argc, char** argv) {
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.substr(0, 9) != "--target=") {
      argv[kept++] = argv[i];
      continue;
    }
    bool found = false;
    for (const int64_t t : hwy::SupportedAndGeneratedTargets()) {
      if (arg.substr(9) == hwy::TargetName(t)) {
        hwy::SetSupportedTargetsForTest(t);
        found = true;
      }
    }
    if (!found) {
      std::fprintf(stderr, "reduce_bench: target %s not available here\n", argv[i] + 9);
      return 2;
    }
  }
  argc = kept;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
