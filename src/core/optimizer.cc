#include "core/optimizer.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/endian.h"

namespace netdam::core {

namespace {

// Record offsets (docs/PROTOCOL.md 6.8).
constexpr size_t kKind = 0, kFlags = 1, kReserved = 2, kStep = 8, kLr = 16, kWeightDecay = 24,
                 kMomentumBeta1 = 32, kDampeningBeta2 = 40, kEps = 48, kGradScale = 56,
                 kState1 = 64, kState2 = 72;
static_assert(kState2 + 8 == kOptConfigRecordSize);
constexpr uint8_t kFlagNesterov = 0x01;

void put_f64(std::byte* p, double v) { store_be<uint64_t>(p, std::bit_cast<uint64_t>(v)); }
double get_f64(const std::byte* p) { return std::bit_cast<double>(load_be<uint64_t>(p)); }

// Elements are processed in blocks copied into local float arrays: the
// arithmetic then runs on unaliased, aligned, fixed-size arrays the compiler
// vectorises (a partial last block is padded with zeros, computed and not
// stored). Every element still gets exactly the operations below.
constexpr size_t kBlock = 64;
using Block = std::array<float, kBlock>;

void load(Block& dst, const std::byte* src, size_t n) {
  if (n < kBlock) dst.fill(0.0f);
  std::memcpy(dst.data(), src, 4 * n);
  if constexpr (std::endian::native == std::endian::big)
    for (float& x : dst) x = std::bit_cast<float>(bswap(std::bit_cast<uint32_t>(x)));
}

void store(std::byte* dst, Block& src, size_t n) {
  if constexpr (std::endian::native == std::endian::big)
    for (float& x : src) x = std::bit_cast<float>(bswap(std::bit_cast<uint32_t>(x)));
  std::memcpy(dst, src.data(), 4 * n);
}

// Scalars as torch applies them to a float32 tensor: computed in double,
// rounded to float32.
struct SgdScalars {
  float gs, wd, momentum, one_minus_dampening, neg_lr;
};

template <bool kWd, bool kMomentum, bool kNesterov, bool kFirst>
void sgd(const SgdScalars k, const std::byte* grad, std::byte* param, std::byte* buf, size_t n) {
  Block g, p, b;
  for (size_t i = 0; i < n; i += kBlock) {
    const size_t m = std::min(kBlock, n - i);
    load(g, grad + 4 * i, m);
    load(p, param + 4 * i, m);
    if (kMomentum && !kFirst) load(b, buf + 4 * i, m);
    for (size_t j = 0; j < kBlock; ++j) {
      float d = g[j] * k.gs;
      if (kWd) d = d + k.wd * p[j];
      if (kMomentum) {
        b[j] = kFirst ? d : b[j] * k.momentum + k.one_minus_dampening * d;
        d = kNesterov ? d + k.momentum * b[j] : b[j];
      }
      p[j] = p[j] + k.neg_lr * d;
    }
    if (kMomentum) store(buf + 4 * i, b, m);
    store(param + 4 * i, p, m);
  }
}

using SgdFn = void (*)(SgdScalars, const std::byte*, std::byte*, std::byte*, size_t);

template <bool kWd, bool kMomentum>
SgdFn pick_sgd(bool nesterov, bool first) {
  if (!kMomentum) return sgd<kWd, false, false, false>;
  if (nesterov) return first ? sgd<kWd, true, true, true> : sgd<kWd, true, true, false>;
  return first ? sgd<kWd, true, false, true> : sgd<kWd, true, false, false>;
}

void sgd(const OptimizerConfig& c, const std::byte* grad, std::byte* param, std::byte* buf,
         size_t n) {
  const SgdScalars k{static_cast<float>(c.grad_scale), static_cast<float>(c.weight_decay),
                     static_cast<float>(c.momentum), static_cast<float>(1.0 - c.dampening),
                     static_cast<float>(-c.lr)};
  const bool wd = c.weight_decay != 0.0, momentum = c.momentum != 0.0, first = c.step == 1;
  SgdFn f = wd ? (momentum ? pick_sgd<true, true>(c.nesterov, first) : pick_sgd<true, false>(false, false))
               : (momentum ? pick_sgd<false, true>(c.nesterov, first) : pick_sgd<false, false>(false, false));
  f(k, grad, param, buf, n);
}

struct AdamScalars {
  float gs, wd, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
};

// kDecoupled: AdamW (p = p * (1 - lr*wd)); else Adam with kWd: g = g + wd*p.
template <bool kDecoupled, bool kWd>
void adam(const AdamScalars k, const std::byte* grad, std::byte* param, std::byte* exp_avg,
          std::byte* exp_avg_sq, size_t n) {
  Block g, p, m, v;
  for (size_t i = 0; i < n; i += kBlock) {
    const size_t len = std::min(kBlock, n - i);
    load(g, grad + 4 * i, len);
    load(p, param + 4 * i, len);
    load(m, exp_avg + 4 * i, len);
    load(v, exp_avg_sq + 4 * i, len);
    for (size_t j = 0; j < kBlock; ++j) {
      float d = g[j] * k.gs;
      if (kDecoupled) p[j] = p[j] * k.decay;
      else if (kWd) d = d + k.wd * p[j];
      m[j] = m[j] * k.beta1 + k.one_minus_beta1 * d;
      v[j] = v[j] * k.beta2 + k.one_minus_beta2 * d * d;
      const float denom = std::sqrt(v[j]) / k.bc2_sqrt + k.eps;
      p[j] = p[j] + k.neg_step_size * m[j] / denom;
    }
    store(exp_avg + 4 * i, m, len);
    store(exp_avg_sq + 4 * i, v, len);
    store(param + 4 * i, p, len);
  }
}

void adam(const OptimizerConfig& c, const std::byte* grad, std::byte* param, std::byte* exp_avg,
          std::byte* exp_avg_sq, size_t n) {
  const auto t = static_cast<double>(c.step);
  const double bias_correction1 = 1.0 - std::pow(c.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(c.beta2, t);
  const double step_size = c.lr / bias_correction1;
  const AdamScalars k{static_cast<float>(c.grad_scale),
                      static_cast<float>(c.weight_decay),
                      static_cast<float>(1.0 - c.lr * c.weight_decay),
                      static_cast<float>(c.beta1),
                      static_cast<float>(1.0 - c.beta1),
                      static_cast<float>(c.beta2),
                      static_cast<float>(1.0 - c.beta2),
                      static_cast<float>(std::sqrt(bias_correction2)),
                      static_cast<float>(c.eps),
                      static_cast<float>(-step_size)};
  if (c.kind == OptimizerKind::kAdamW)
    adam<true, false>(k, grad, param, exp_avg, exp_avg_sq, n);
  else if (c.weight_decay != 0.0)
    adam<false, true>(k, grad, param, exp_avg, exp_avg_sq, n);
  else
    adam<false, false>(k, grad, param, exp_avg, exp_avg_sq, n);
}

}  // namespace

void encode_opt_config(const OptimizerConfig& c, std::byte* out) {
  std::memset(out, 0, kOptConfigRecordSize);
  const bool sgd = c.kind == OptimizerKind::kSgd;
  store_be<uint8_t>(out + kKind, static_cast<uint8_t>(c.kind));
  store_be<uint8_t>(out + kFlags, c.nesterov ? kFlagNesterov : 0);
  store_be<uint64_t>(out + kStep, c.step);
  put_f64(out + kLr, c.lr);
  put_f64(out + kWeightDecay, c.weight_decay);
  put_f64(out + kMomentumBeta1, sgd ? c.momentum : c.beta1);
  put_f64(out + kDampeningBeta2, sgd ? c.dampening : c.beta2);
  put_f64(out + kEps, c.eps);
  put_f64(out + kGradScale, c.grad_scale);
  store_be<uint64_t>(out + kState1, c.state1_offset);
  store_be<uint64_t>(out + kState2, c.state2_offset);
}

bool decode_opt_config(std::span<const std::byte> in, OptimizerConfig& out) {
  if (in.size() != kOptConfigRecordSize) return false;
  const std::byte* r = in.data();
  const auto kind = load_be<uint8_t>(r + kKind);
  const auto flags = load_be<uint8_t>(r + kFlags);
  if (kind < 1 || kind > 3 || (flags & ~kFlagNesterov)) return false;
  for (size_t i = kReserved; i < kStep; ++i)
    if (r[i] != std::byte{0}) return false;
  OptimizerConfig c;
  c.kind = static_cast<OptimizerKind>(kind);
  c.nesterov = flags & kFlagNesterov;
  c.step = load_be<uint64_t>(r + kStep);
  c.lr = get_f64(r + kLr);
  c.weight_decay = get_f64(r + kWeightDecay);
  if (c.kind == OptimizerKind::kSgd) {
    c.momentum = get_f64(r + kMomentumBeta1);
    c.dampening = get_f64(r + kDampeningBeta2);
  } else {
    c.beta1 = get_f64(r + kMomentumBeta1);
    c.beta2 = get_f64(r + kDampeningBeta2);
  }
  c.eps = get_f64(r + kEps);
  c.grad_scale = get_f64(r + kGradScale);
  c.state1_offset = load_be<uint64_t>(r + kState1);
  c.state2_offset = load_be<uint64_t>(r + kState2);
  if (c.step == 0) return false;
  // torch refuses these ("Nesterov momentum requires a momentum and zero
  // dampening"); so does the device.
  if (c.nesterov && (c.kind != OptimizerKind::kSgd || !(c.momentum > 0.0) || c.dampening != 0.0))
    return false;
  out = c;
  return true;
}

void optimizer_step(const OptimizerConfig& c, std::span<const std::byte> grad,
                    std::span<std::byte> param, std::span<std::byte> state1,
                    std::span<std::byte> state2) {
  const size_t n = grad.size() / 4;
  if (c.kind == OptimizerKind::kSgd)
    sgd(c, grad.data(), param.data(), state1.data(), n);
  else
    adam(c, grad.data(), param.data(), state1.data(), state2.data(), n);
}

}  // namespace netdam::core
