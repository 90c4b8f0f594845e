// Optimizer offload: the arithmetic of OPT_STEP and the OPT_CONFIG record.
//
// optimizer_step() applies one step of SGD, Adam or AdamW to n float32
// parameters, following torch 1.13's single-tensor CPU implementations
// (torch/optim/sgd.py _single_tensor_sgd, adam.py _single_tensor_adam,
// adamw.py _single_tensor_adamw): element arithmetic in float32, python
// scalars (bias corrections, 1 - beta, -lr, ...) computed in double and
// rounded to float32 when applied. Per element, with g the gradient:
//
//   g = g * grad_scale
//   SGD    if wd:       g = g + wd*p
//          if momentum: buf = (t == 1) ? g : momentum*buf + (1-dampening)*g
//                       g = nesterov ? g + momentum*buf : buf
//          p = p + (-lr)*g
//   Adam   if wd:       g = g + wd*p
//   AdamW  p = p * (1 - lr*wd)                              (no wd term in g)
//   both   m = beta1*m + (1-beta1)*g
//          v = beta2*v + (1-beta2)*g*g
//          bc1 = 1 - beta1^t, bc2 = 1 - beta2^t             (double)
//          p = p + (-(lr/bc1)) * m / (sqrt(v)/sqrt(bc2) + eps)
//
// docs/PROTOCOL.md (6.11, 6.12) states the same rules and the record layout.
// All functions are pure and reentrant.
#pragma once

#include <cstddef>
#include <span>

#include "netdam/optimizer.h"

namespace netdam::core {

// Writes the 80-byte big-endian OPT_CONFIG record.
void encode_opt_config(const OptimizerConfig& c, std::byte* out);

// Parses an OPT_CONFIG record. False (and `out` unspecified) unless `in` is
// exactly 80 bytes with a known kind, no reserved flag or byte set, nesterov
// only for SGD with momentum > 0 and dampening == 0, and step >= 1.
bool decode_opt_config(std::span<const std::byte> in, OptimizerConfig& out);

// One optimizer step. grad, param, state1 and state2 hold n little-endian
// float32 each (raw bytes, any alignment); state1 (momentum buffer /
// exp_avg) may be empty when !c.uses_state1(), state2 (exp_avg_sq) when
// !c.uses_state2(). Blocks of elements are read before they are written, so
// overlapping buffers are memory-safe (their values are then unspecified).
// Precondition: the used spans are grad.size() bytes, a multiple of 4.
void optimizer_step(const OptimizerConfig& c, std::span<const std::byte> grad,
                    std::span<std::byte> param, std::span<std::byte> state1,
                    std::span<std::byte> state2);

}  // namespace netdam::core
