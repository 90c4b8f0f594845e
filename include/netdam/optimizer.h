// Optimizer offload (OPT_CONFIG / OPT_STEP, docs/PROTOCOL.md 6.11-6.12): a
// region holds an optimizer config; OPT_STEP sends a float32 gradient and
// the device updates the parameters (and the optimizer state stored next to
// them) as torch 1.13's single-tensor SGD, Adam or AdamW would.
#pragma once

#include <cstdint>

namespace netdam {

// Wire values of the record's kind byte.
enum class OptimizerKind : uint8_t {
  kSgd = 1,
  kAdam = 2,
  kAdamW = 3,
};

// The 80-byte OPT_CONFIG record, in host form. `momentum` and `beta1` share
// one wire slot (offset 32), `dampening` and `beta2` another (offset 40):
// the encoder sends the pair that belongs to `kind`, the decoder fills that
// pair and leaves the other at its default.
struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kSgd;
  bool nesterov = false;      // SGD only; needs momentum > 0 and dampening == 0 (as torch)
  uint64_t step = 1;          // t, 1-based: Adam bias correction; SGD t == 1 sets buf = g
  double lr = 1e-3;
  double weight_decay = 0.0;
  double momentum = 0.0;      // SGD
  double dampening = 0.0;     // SGD
  double beta1 = 0.9;         // Adam, AdamW
  double beta2 = 0.999;       // Adam, AdamW
  double eps = 1e-8;          // Adam, AdamW
  double grad_scale = 1.0;    // the gradient is multiplied by this first
  // Bytes from a parameter's address to its state: state1 = SGD momentum
  // buffer / Adam exp_avg, state2 = Adam exp_avg_sq. Unused slots are ignored.
  uint64_t state1_offset = 0;
  uint64_t state2_offset = 0;

  bool is_adam() const { return kind == OptimizerKind::kAdam || kind == OptimizerKind::kAdamW; }
  bool uses_state1() const { return is_adam() || momentum != 0.0; }
  bool uses_state2() const { return is_adam(); }
  friend bool operator==(const OptimizerConfig&, const OptimizerConfig&) = default;
};

inline constexpr uint32_t kOptConfigRecordSize = 80;

}  // namespace netdam
