#include "core/optimizer.h"

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

float ld(const std::byte* p) { return std::bit_cast<float>(load_le<uint32_t>(p)); }
void st(std::byte* p, float v) { store_le<uint32_t>(p, std::bit_cast<uint32_t>(v)); }

// Scalars as torch applies them to a float32 tensor: computed in double,
// rounded to float32.
struct SgdScalars {
  float gs, wd, momentum, one_minus_dampening, neg_lr;
};

void sgd(const OptimizerConfig& c, const std::byte* grad, std::byte* param, std::byte* buf,
         size_t n) {
  const SgdScalars k{static_cast<float>(c.grad_scale), static_cast<float>(c.weight_decay),
                     static_cast<float>(c.momentum), static_cast<float>(1.0 - c.dampening),
                     static_cast<float>(-c.lr)};
  const bool wd = c.weight_decay != 0.0, momentum = c.momentum != 0.0, first = c.step == 1;
  for (size_t i = 0; i < n; ++i) {
    const size_t o = 4 * i;
    const float p = ld(param + o);
    float g = ld(grad + o) * k.gs;
    if (wd) g = g + k.wd * p;
    if (momentum) {
      const float b = first ? g : ld(buf + o) * k.momentum + k.one_minus_dampening * g;
      st(buf + o, b);
      g = c.nesterov ? g + k.momentum * b : b;
    }
    st(param + o, p + k.neg_lr * g);
  }
}

void adam(const OptimizerConfig& c, const std::byte* grad, std::byte* param, std::byte* exp_avg,
          std::byte* exp_avg_sq, size_t n) {
  const auto t = static_cast<double>(c.step);
  const double bias_correction1 = 1.0 - std::pow(c.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(c.beta2, t);
  const double step_size = c.lr / bias_correction1;
  const auto gs = static_cast<float>(c.grad_scale);
  const bool adamw = c.kind == OptimizerKind::kAdamW;
  const bool wd = c.weight_decay != 0.0;
  const auto wd_f = static_cast<float>(c.weight_decay);
  const auto decay = static_cast<float>(1.0 - c.lr * c.weight_decay);  // AdamW
  const auto beta1 = static_cast<float>(c.beta1), one_minus_beta1 = static_cast<float>(1.0 - c.beta1);
  const auto beta2 = static_cast<float>(c.beta2), one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  const auto bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  const auto eps = static_cast<float>(c.eps);
  const auto neg_step_size = static_cast<float>(-step_size);
  for (size_t i = 0; i < n; ++i) {
    const size_t o = 4 * i;
    float p = ld(param + o);
    float g = ld(grad + o) * gs;
    if (adamw) {
      p = p * decay;
    } else if (wd) {
      g = g + wd_f * p;
    }
    const float m = ld(exp_avg + o) * beta1 + one_minus_beta1 * g;
    const float v = ld(exp_avg_sq + o) * beta2 + one_minus_beta2 * g * g;
    const float denom = std::sqrt(v) / bc2_sqrt + eps;
    st(exp_avg + o, m);
    st(exp_avg_sq + o, v);
    st(param + o, p + neg_step_size * m / denom);
  }
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
