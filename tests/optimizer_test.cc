// Optimizer offload (OPT_CONFIG / OPT_STEP, PROTOCOL.md 6.11-6.12): the
// record's golden bytes, the arithmetic of src/core/optimizer against plain
// double-precision loops, the engine's checks and exactly-once execution
// (plain and as the last segment of a chain, with STAMP), and the client
// over the lossy in-process fabric.
#include "core/optimizer.h"

#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "core/endian.h"
#include "core/engine.h"
#include "core/reduce.h"
#include "core/sparse.h"
#include "core/wire.h"
#include "daemon/device_loop.h"
#include "netdam/client.h"
#include "transport/fabric.h"

namespace netdam {
void PrintTo(Status s, std::ostream* os) { *os << to_string(s); }
}  // namespace netdam

namespace netdam::core {
namespace {

using Bytes = std::vector<std::byte>;

Bytes Hex(const char* hex) {
  Bytes b;
  for (const char* p = hex; p[0] && p[1];) {
    if (*p == ' ') {
      ++p;
      continue;
    }
    b.push_back(static_cast<std::byte>(std::stoi(std::string(p, 2), nullptr, 16)));
    p += 2;
  }
  return b;
}

Bytes F32s(const std::vector<float>& v) {
  Bytes b(v.size() * 4);
  for (size_t i = 0; i < v.size(); ++i) store_le<uint32_t>(b.data() + 4 * i, std::bit_cast<uint32_t>(v[i]));
  return b;
}

std::vector<float> Floats(std::span<const std::byte> b) {
  std::vector<float> v(b.size() / 4);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::bit_cast<float>(load_le<uint32_t>(b.data() + 4 * i));
  return v;
}

std::vector<float> RandomFloats(size_t n, std::mt19937_64& rng, double scale = 1.0) {
  std::uniform_real_distribution<double> u(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(u(rng));
  return v;
}

OptimizerConfig Adam(uint64_t step, OptimizerKind kind = OptimizerKind::kAdam) {
  OptimizerConfig c;
  c.kind = kind;
  c.step = step;
  c.lr = 1e-3;
  c.weight_decay = 0.01;
  c.beta1 = 0.9;
  c.beta2 = 0.999;
  c.eps = 1e-8;
  c.grad_scale = 0.5;
  c.state1_offset = 0x1000;
  c.state2_offset = 0x2000;
  return c;
}

// ---------------------------------------------------------------- the record

TEST(OptConfigRecord, GoldenBytes) {
  Bytes rec(kOptConfigRecordSize);
  encode_opt_config(Adam(3), rec.data());
  EXPECT_EQ(rec, Hex("02 00 000000000000"
                     "0000000000000003"    // step
                     "3f50624dd2f1a9fc"    // lr 1e-3
                     "3f847ae147ae147b"    // weight_decay 0.01
                     "3feccccccccccccd"    // beta1 0.9
                     "3feff7ced916872b"    // beta2 0.999
                     "3e45798ee2308c3a"    // eps 1e-8
                     "3fe0000000000000"    // grad_scale 0.5
                     "0000000000001000"    // state1
                     "0000000000002000")); // state2

  OptimizerConfig sgd;
  sgd.kind = OptimizerKind::kSgd;
  sgd.nesterov = true;
  sgd.step = 1;
  sgd.lr = 0.5;
  sgd.momentum = 0.9;
  sgd.dampening = 0.0;
  sgd.eps = 0.0;
  sgd.grad_scale = 1.0;
  sgd.state1_offset = 64;
  encode_opt_config(sgd, rec.data());
  EXPECT_EQ(rec, Hex("01 01 000000000000 0000000000000001 3fe0000000000000 0000000000000000"
                     "3feccccccccccccd 0000000000000000 0000000000000000 3ff0000000000000"
                     "0000000000000040 0000000000000000"));
}

TEST(OptConfigRecord, GoldenRequests) {
  // OPT_CONFIG: rkey 7, addr 0, length 80, txn 0x0102030405060708.
  Header h;
  h.opcode = Opcode::kOptConfig;
  h.rkey = 7;
  h.txn = 0x0102030405060708;
  h.length = kOptConfigRecordSize;
  Bytes d(kHeaderSize);
  encode_header(h, d.data());
  EXPECT_EQ(d, Hex("4e44414d 01 33 00 00 00 00 00 00 00000007 0102030405060708"
                   "0000000000000000 00000050 00000000"));
  // OPT_STEP: f32, redop none, two gradient elements at 0x100.
  h.opcode = Opcode::kOptStep;
  h.dtype = DType::kF32;
  h.txn = 9;
  h.addr = 0x100;
  h.length = 8;
  Bytes grad = F32s({1.0f, -2.0f});
  d.resize(kHeaderSize);
  encode_header(h, d.data());
  d.insert(d.end(), grad.begin(), grad.end());
  EXPECT_EQ(d, Hex("4e44414d 01 34 00 00 01 00 00 00 00000007 0000000000000009"
                   "0000000000000100 00000008 00000000 0000803f 000000c0"));
  EXPECT_EQ(to_string(Opcode::kOptConfig), "OPT_CONFIG");
  EXPECT_EQ(to_string(Opcode::kOptStep), "OPT_STEP");
  EXPECT_EQ(to_string(Status::kNoOptimizer), "NO_OPTIMIZER");
  EXPECT_EQ(static_cast<int>(Status::kNoOptimizer), 22);
}

TEST(OptConfigRecord, RoundTripAndRejects) {
  Bytes rec(kOptConfigRecordSize);
  for (auto kind : {OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    encode_opt_config(Adam(7, kind), rec.data());
    OptimizerConfig back;
    ASSERT_TRUE(decode_opt_config(rec, back));
    EXPECT_EQ(back, Adam(7, kind));
  }
  OptimizerConfig sgd;
  sgd.momentum = 0.9;
  sgd.dampening = 0.1;
  sgd.weight_decay = 1e-4;
  sgd.state1_offset = 0x40;
  encode_opt_config(sgd, rec.data());
  OptimizerConfig back;
  ASSERT_TRUE(decode_opt_config(rec, back));
  EXPECT_EQ(back, sgd);

  encode_opt_config(Adam(1), rec.data());
  auto rejects = [&](size_t off, uint8_t value) {
    Bytes bad = rec;
    bad[off] = static_cast<std::byte>(value);
    OptimizerConfig c;
    return !decode_opt_config(bad, c);
  };
  EXPECT_TRUE(rejects(0, 0));
  EXPECT_TRUE(rejects(0, 4));
  EXPECT_TRUE(rejects(1, 0x02));   // reserved flag
  EXPECT_TRUE(rejects(1, 0x01));   // nesterov on Adam
  EXPECT_TRUE(rejects(5, 0x01));   // reserved byte
  EXPECT_TRUE(rejects(15, 0x00));  // step 1 -> 0
  EXPECT_FALSE(rejects(15, 0x02));
  OptimizerConfig c;
  EXPECT_FALSE(decode_opt_config(std::span(rec).first(79), c));
  // nesterov needs momentum > 0 and zero dampening (torch's rule).
  OptimizerConfig nest;
  nest.nesterov = true;
  encode_opt_config(nest, rec.data());
  EXPECT_FALSE(decode_opt_config(rec, c));
  nest.momentum = 0.9;
  nest.dampening = 0.5;
  encode_opt_config(nest, rec.data());
  EXPECT_FALSE(decode_opt_config(rec, c));
  nest.dampening = 0.0;
  encode_opt_config(nest, rec.data());
  EXPECT_TRUE(decode_opt_config(rec, c));
}

// ---------------------------------------------------------------- arithmetic

// State of one parameter vector for the double-precision reference.
struct RefState {
  std::vector<double> p, s1, s2;
};

void RefStep(const OptimizerConfig& c, const std::vector<float>& grad, RefState& r) {
  const double t = static_cast<double>(c.step);
  for (size_t i = 0; i < grad.size(); ++i) {
    double g = grad[i] * c.grad_scale;
    double& p = r.p[i];
    if (c.kind == OptimizerKind::kSgd) {
      if (c.weight_decay != 0) g += c.weight_decay * p;
      if (c.momentum != 0) {
        r.s1[i] = c.step == 1 ? g : c.momentum * r.s1[i] + (1 - c.dampening) * g;
        g = c.nesterov ? g + c.momentum * r.s1[i] : r.s1[i];
      }
      p -= c.lr * g;
    } else {
      if (c.kind == OptimizerKind::kAdamW) p *= 1 - c.lr * c.weight_decay;
      else if (c.weight_decay != 0) g += c.weight_decay * p;
      r.s1[i] = c.beta1 * r.s1[i] + (1 - c.beta1) * g;
      r.s2[i] = c.beta2 * r.s2[i] + (1 - c.beta2) * g * g;
      const double bc1 = 1 - std::pow(c.beta1, t), bc2 = 1 - std::pow(c.beta2, t);
      p -= (c.lr / bc1) * r.s1[i] / (std::sqrt(r.s2[i]) / std::sqrt(bc2) + c.eps);
    }
  }
}

void ExpectNear(const std::vector<float>& got, const std::vector<double>& want, const char* what,
                int step) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 2e-5 * std::max(1.0, std::abs(want[i])))
        << what << "[" << i << "] after step " << step;
}

// Runs `steps` steps of optimizer_step and of the reference from the same
// start; the state starts as garbage for SGD (t == 1 must overwrite it) and
// as zeros for Adam (as torch initialises it).
void CompareWithReference(OptimizerConfig c, int steps, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const size_t n = 257;
  std::vector<float> p0 = RandomFloats(n, rng);
  Bytes param = F32s(p0), s1(n * 4), s2(n * 4);
  if (c.kind == OptimizerKind::kSgd)
    for (size_t i = 0; i < n; ++i) store_le<uint32_t>(s1.data() + 4 * i, 0x7FC00000u);  // NaN
  RefState ref{{p0.begin(), p0.end()}, std::vector<double>(n), std::vector<double>(n)};
  for (int k = 1; k <= steps; ++k) {
    c.step = static_cast<uint64_t>(k);
    std::vector<float> g = RandomFloats(n, rng, 2.0);
    optimizer_step(c, F32s(g), param, c.uses_state1() ? std::span<std::byte>(s1) : std::span<std::byte>{},
                   c.uses_state2() ? std::span<std::byte>(s2) : std::span<std::byte>{});
    RefStep(c, g, ref);
    ExpectNear(Floats(param), ref.p, "param", k);
    if (c.uses_state1()) ExpectNear(Floats(s1), ref.s1, "state1", k);
    if (c.uses_state2()) ExpectNear(Floats(s2), ref.s2, "state2", k);
  }
}

TEST(OptimizerStep, SgdVariantsMatchReference) {
  struct V {
    double momentum, dampening, wd;
    bool nesterov;
  };
  const V variants[] = {{0, 0, 0, false},   {0, 0, 0.01, false},  {0.9, 0, 0, false},
                        {0.9, 0.1, 0, false}, {0.9, 0, 0.01, true}, {0.5, 0.3, 0.05, false}};
  uint64_t seed = 1;
  for (const V& v : variants) {
    OptimizerConfig c;
    c.kind = OptimizerKind::kSgd;
    c.lr = 0.05;
    c.momentum = v.momentum;
    c.dampening = v.dampening;
    c.weight_decay = v.wd;
    c.nesterov = v.nesterov;
    c.grad_scale = 0.25;
    SCOPED_TRACE(testing::Message() << "momentum " << v.momentum << " dampening " << v.dampening
                                    << " wd " << v.wd << " nesterov " << v.nesterov);
    CompareWithReference(c, 6, seed++);
  }
}

TEST(OptimizerStep, AdamAndAdamWMatchReference) {
  for (auto kind : {OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    for (double wd : {0.0, 0.05}) {
      OptimizerConfig c = Adam(1, kind);
      c.weight_decay = wd;
      c.lr = 0.01;
      SCOPED_TRACE(testing::Message() << "kind " << int(kind) << " wd " << wd);
      CompareWithReference(c, 6, 100 + static_cast<uint64_t>(kind));
    }
  }
}

TEST(OptimizerStep, SgdFirstStepSetsTheBufferToTheGradient) {
  OptimizerConfig c;
  c.momentum = 0.9;
  c.dampening = 0.5;  // would scale g if the buffer were updated, not set
  c.lr = 1.0;
  c.step = 1;
  Bytes p = F32s({1.0f, 2.0f}), buf = F32s({100.0f, -7.0f});
  optimizer_step(c, F32s({0.5f, -0.25f}), p, buf, {});
  EXPECT_EQ(Floats(buf), (std::vector<float>{0.5f, -0.25f}));
  EXPECT_EQ(Floats(p), (std::vector<float>{0.5f, 2.25f}));
  c.step = 2;  // now buf = 0.9 * buf + 0.5 * g
  optimizer_step(c, F32s({1.0f, 1.0f}), p, buf, {});
  EXPECT_FLOAT_EQ(Floats(buf)[0], 0.9f * 0.5f + 0.5f);
  EXPECT_FLOAT_EQ(Floats(buf)[1], 0.9f * -0.25f + 0.5f);
}

// Values torch 1.13 printed for these inputs (torch.optim.Adam / AdamW,
// float32, 3 steps, see the comment in each case): agreement to float32
// rounding, not a reimplementation of the same formula by the same hand.
TEST(OptimizerStep, AgreesWithTorchValues) {
  // p = [1, -2, 0.5], grads [0.1, 0.2, -0.3], [-0.5, 0.1, 0.05], [0.2, -0.2, 0.1],
  // Adam(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
  const std::vector<std::vector<float>> grads = {{0.1f, 0.2f, -0.3f}, {-0.5f, 0.1f, 0.05f},
                                                 {0.2f, -0.2f, 0.1f}};
  struct Case {
    OptimizerKind kind;
    std::vector<float> want;
  };
  // SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1), same inputs.
  OptimizerConfig sgd;
  sgd.momentum = 0.9;
  sgd.nesterov = true;
  const std::vector<Case> cases = {
      {OptimizerKind::kAdam, {0.927303731f, -1.84948719f, 0.619362116f}},
      {OptimizerKind::kAdamW, {0.951245546f, -2.14197206f, 0.656046271f}},
      {OptimizerKind::kSgd, {0.983221829f, -1.8972609f, 0.528178632f}}};
  for (const Case& k : cases) {
    OptimizerConfig c = k.kind == OptimizerKind::kSgd ? sgd : Adam(1, k.kind);
    c.lr = 0.1;
    c.weight_decay = 0.1;
    c.grad_scale = 1.0;
    Bytes p = F32s({1.0f, -2.0f, 0.5f}), m(12), v(12);
    for (size_t s = 0; s < grads.size(); ++s) {
      c.step = s + 1;
      optimizer_step(c, F32s(grads[s]), p, m, v);
    }
    const std::vector<float> got = Floats(p);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], k.want[i], 1e-6) << int(k.kind) << " " << i;
  }
}

}  // namespace
}  // namespace netdam::core
