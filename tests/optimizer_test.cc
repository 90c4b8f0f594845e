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

// ---------------------------------------------------------------- engine

constexpr uint32_t kKeyRW = 7;     // [0, 32 KiB) read/write
constexpr uint32_t kKeyRO = 9;     // [32 KiB, 48 KiB) read-only
constexpr uint32_t kAdmin = 0xAD;
constexpr uint64_t kRwSize = 32 << 10;
constexpr Address kClient{0x0A000001, 5000};
constexpr Address kDev[3] = {{0x0A000010, 7000}, {0x0A000011, 7000}, {0x0A000012, 7000}};

struct Answer {
  Action::Kind kind = Action::Kind::kNone;
  Header h;
  Bytes wire;
  Status status() const { return h.status; }
};

struct Dev {
  Dev() : mem(64 << 10) {
    for (size_t i = 0; i < mem.size(); ++i) mem[i] = static_cast<std::byte>(i * 7 + 3);
    DeviceConfig c;
    c.boot_id = 0xB0071;
    c.admin_key = kAdmin;
    dev = std::make_unique<Device>(mem, c);
    eng = std::make_unique<Engine>(*dev);
    out.resize(Engine::out_buffer_size(dev->config()));
    EXPECT_EQ(dev->regions().add(Region{0, kRwSize, kKeyRW, kPermAll}), Status::kOk);
    EXPECT_EQ(dev->regions().add(Region{kRwSize, 16 << 10, kKeyRO, kPermRead}), Status::kOk);
  }
  ~Dev() { eng.reset(); }
  Answer Send(Address from, Bytes d) {
    Action a = eng->handle(from, d, out);
    Answer r;
    r.kind = a.kind;
    r.wire.assign(a.head.begin(), a.head.end());
    r.wire.insert(r.wire.end(), a.data.begin(), a.data.end());
    if (r.wire.size() >= kHeaderSize) r.h = decode_header(r.wire.data());
    return r;
  }
  uint64_t Stat(const std::string& name) const {
    for (auto& [k, v] : dev->stats())
      if (k == name) return v;
    return 0;
  }
  std::vector<float> At(uint64_t addr, size_t n) const { return Floats(std::span(mem).subspan(addr, 4 * n)); }
  void Put(uint64_t addr, const std::vector<float>& v) {
    Bytes b = F32s(v);
    std::copy(b.begin(), b.end(), mem.begin() + static_cast<ptrdiff_t>(addr));
  }

  Bytes mem;
  std::unique_ptr<Device> dev;
  std::unique_ptr<Engine> eng;
  Bytes out;
};

Bytes Datagram(const Header& h, const Bytes& payload) {
  Bytes d(kHeaderSize + payload.size());
  encode_header(h, d.data());
  std::copy(payload.begin(), payload.end(), d.begin() + kHeaderSize);
  return d;
}

class OptEngine : public ::testing::Test {
 protected:
  Bytes Record(const OptimizerConfig& c) {
    Bytes r(kOptConfigRecordSize);
    encode_opt_config(c, r.data());
    return r;
  }
  Header ConfigHeader(uint32_t rkey = kKeyRW) {
    Header h;
    h.opcode = Opcode::kOptConfig;
    h.rkey = rkey;
    h.txn = ++txn_;
    h.length = kOptConfigRecordSize;
    return h;
  }
  Status Config(const OptimizerConfig& c, uint32_t rkey = kKeyRW) {
    return d_.Send(kClient, Datagram(ConfigHeader(rkey), Record(c))).status();
  }
  Header StepHeader(uint64_t addr, uint32_t length, uint32_t rkey = kKeyRW) {
    Header h;
    h.opcode = Opcode::kOptStep;
    h.rkey = rkey;
    h.txn = ++txn_;
    h.addr = addr;
    h.length = length;
    h.dtype = DType::kF32;
    return h;
  }
  Status Step(uint64_t addr, const std::vector<float>& g, uint32_t rkey = kKeyRW) {
    return d_.Send(kClient, Datagram(StepHeader(addr, static_cast<uint32_t>(4 * g.size()), rkey), F32s(g)))
        .status();
  }

  Dev d_;
  uint64_t txn_ = 100;
};

TEST_F(OptEngine, ConfigErrors) {
  const Bytes good = Record(Adam(1));
  auto send = [&](Header h, const Bytes& payload) { return d_.Send(kClient, Datagram(h, payload)).status(); };
  Header h = ConfigHeader();
  h.length = 79;
  EXPECT_EQ(send(h, Bytes(good.begin(), good.end() - 1)), Status::kBadLength);
  EXPECT_EQ(send(ConfigHeader(), Bytes(good.begin(), good.end() - 1)), Status::kBadLength);
  h = ConfigHeader();
  h.addr = 4;
  EXPECT_EQ(send(h, good), Status::kOutOfBounds);
  for (auto [off, value] : {std::pair<size_t, uint8_t>{0, 0}, {0, 4}, {1, 2}, {1, 1}, {3, 1}, {15, 0}}) {
    Bytes bad = good;
    bad[off] = static_cast<std::byte>(value);
    EXPECT_EQ(send(ConfigHeader(), bad), Status::kBadPayload) << off << " " << int(value);
  }
  EXPECT_EQ(send(ConfigHeader(99), good), Status::kBadKey);
  EXPECT_EQ(send(ConfigHeader(kKeyRO), good), Status::kNotPermitted);
  h = ConfigHeader();
  h.flags = kFlagSparse;
  EXPECT_EQ(send(h, good), Status::kBadFlags);
  EXPECT_EQ(send(ConfigHeader(), good), Status::kOk);
  EXPECT_EQ(d_.Stat("op.OPT_CONFIG"), 13u);
}

TEST_F(OptEngine, StepErrorsWriteNothing) {
  const Bytes snap = d_.mem;
  EXPECT_EQ(Step(0x100, {1, 2}), Status::kNoOptimizer);
  EXPECT_EQ(d_.Stat("nak.NO_OPTIMIZER"), 1u);
  ASSERT_EQ(Config(Adam(1)), Status::kOk);  // state at +0x1000, +0x2000
  const Bytes grad = F32s({1, 2});
  auto send = [&](Header h, const Bytes& payload = {}) {
    return d_.Send(kClient, Datagram(h, payload.empty() ? grad : payload)).status();
  };
  Header h = StepHeader(0x100, 8);
  h.dtype = DType::kF64;
  EXPECT_EQ(send(h), Status::kBadType);
  h = StepHeader(0x100, 8);
  h.redop = RedOp::kSum;
  EXPECT_EQ(send(h), Status::kBadRedop);
  EXPECT_EQ(send(StepHeader(0x100, 6), Bytes(grad.begin(), grad.begin() + 6)), Status::kBadLength);
  EXPECT_EQ(send(StepHeader(0x100, 12)), Status::kBadLength);  // payload != length
  EXPECT_EQ(send(StepHeader(0x102, 8)), Status::kMisaligned);
  EXPECT_EQ(send(StepHeader(0x100, 8, 99)), Status::kBadKey);
  EXPECT_EQ(send(StepHeader(kRwSize - 4, 8)), Status::kOutOfBounds);  // parameters
  // Parameters inside, exp_avg_sq (+0x2000) past the region's end.
  EXPECT_EQ(send(StepHeader(kRwSize - 0x2000, 8)), Status::kOutOfBounds);
  // Offsets that wrap around 2^64.
  OptimizerConfig wrap = Adam(1);
  wrap.state2_offset = ~uint64_t{0} - 0x40;
  ASSERT_EQ(Config(wrap), Status::kOk);
  EXPECT_EQ(send(StepHeader(0x100, 8)), Status::kOutOfBounds);
  // Malformed sparse gradient.
  h = StepHeader(0x100, 8);
  h.flags = kFlagSparse;
  EXPECT_EQ(send(h, Bytes(5)), Status::kBadPayload);
  // The read-only region may hold no config at all.
  EXPECT_EQ(Step(kRwSize, {1}, kKeyRO), Status::kNoOptimizer);
  EXPECT_TRUE(d_.mem == snap);
}

TEST_F(OptEngine, StateNeedsReadWriteAccess) {
  // SGD with momentum: state1 in the read-only region -> out of the key's region.
  OptimizerConfig c;
  c.momentum = 0.9;
  c.state1_offset = kRwSize;
  ASSERT_EQ(Config(c), Status::kOk);
  EXPECT_EQ(Step(0x100, {1}), Status::kOutOfBounds);
  // Without momentum SGD has no state: the offset is not checked.
  c.momentum = 0.0;
  ASSERT_EQ(Config(c), Status::kOk);
  EXPECT_EQ(Step(0x100, {1}), Status::kOk);
}

TEST_F(OptEngine, StepMatchesCoreAndSparseMatchesDense) {
  std::mt19937_64 rng(3);
  std::vector<float> p = RandomFloats(64, rng), g = RandomFloats(64, rng);
  for (size_t i = 0; i < g.size(); i += 3) g[i] = 0.0f;
  for (size_t i = 0; i < g.size(); i += 2) g[i] = 0.0f;
  const OptimizerConfig c = Adam(1, OptimizerKind::kAdamW);
  Bytes want_p = F32s(p), want_m(256), want_v(256);
  optimizer_step(c, F32s(g), want_p, want_m, want_v);
  for (bool sparse : {false, true}) {
    Dev fresh;
    fresh.Put(0x400, p);
    std::fill(fresh.mem.begin() + 0x1400, fresh.mem.begin() + 0x1500, std::byte{0});
    std::fill(fresh.mem.begin() + 0x2400, fresh.mem.begin() + 0x2500, std::byte{0});
    ASSERT_EQ(fresh.Send(kClient, Datagram(ConfigHeader(), Record(c))).status(), Status::kOk);
    Header h = StepHeader(0x400, 256);
    Bytes payload = F32s(g);
    if (sparse) {
      h.flags = kFlagSparse;
      payload.resize(sparse_encoded_size(DType::kF32, F32s(g)));
      sparse_encode(DType::kF32, F32s(g), payload);
      ASSERT_LT(payload.size(), 256u);
    }
    ASSERT_EQ(fresh.Send(kClient, Datagram(h, payload)).status(), Status::kOk) << sparse;
    EXPECT_EQ(fresh.At(0x400, 64), Floats(want_p)) << sparse;
    EXPECT_EQ(fresh.At(0x1400, 64), Floats(want_m)) << sparse;
    EXPECT_EQ(fresh.At(0x2400, 64), Floats(want_v)) << sparse;
  }
}

TEST_F(OptEngine, DuplicateAppliesOnce) {
  OptimizerConfig c;
  c.lr = 1.0;
  ASSERT_EQ(Config(c), Status::kOk);
  d_.Put(0x100, {10.0f, 20.0f});
  const Bytes d = Datagram(StepHeader(0x100, 8), F32s({1.0f, 2.0f}));
  EXPECT_EQ(d_.Send(kClient, d).status(), Status::kOk);
  EXPECT_EQ(d_.Send(kClient, d).status(), Status::kOk);  // retransmission: answered, not run
  EXPECT_EQ(d_.At(0x100, 2), (std::vector<float>{9.0f, 18.0f}));
  EXPECT_EQ(d_.Stat("replayed"), 1u);
  // The same txn from another port is another requester: it runs.
  EXPECT_EQ(d_.Send(Address{kClient.ip, 5001}, d).status(), Status::kOk);
  EXPECT_EQ(d_.At(0x100, 2), (std::vector<float>{8.0f, 16.0f}));
}

TEST_F(OptEngine, LateConfigDuplicateDoesNotRollBack) {
  OptimizerConfig c;
  c.lr = 1.0;
  const Bytes old = Datagram(ConfigHeader(), Record(c));
  ASSERT_EQ(d_.Send(kClient, old).status(), Status::kOk);
  c.lr = 2.0;
  ASSERT_EQ(Config(c), Status::kOk);
  EXPECT_EQ(d_.Send(kClient, old).status(), Status::kOk);  // a late copy of the first
  d_.Put(0x100, {10.0f});
  ASSERT_EQ(Step(0x100, {1.0f}), Status::kOk);
  EXPECT_EQ(d_.At(0x100, 1), (std::vector<float>{8.0f}));  // lr 2
}

TEST_F(OptEngine, ConfigIsDroppedWithItsRegion) {
  ASSERT_EQ(Config(OptimizerConfig{}), Status::kOk);
  ASSERT_EQ(Step(0x100, {1.0f}), Status::kOk);
  ASSERT_EQ(d_.dev->regions().remove(kKeyRW), Status::kOk);
  ASSERT_EQ(d_.dev->regions().add(Region{0, kRwSize, kKeyRW, kPermAll}), Status::kOk);
  EXPECT_EQ(Step(0x100, {1.0f}), Status::kNoOptimizer);
}

Segment Seg(Address at, Opcode op, uint64_t addr, uint8_t flags = 0, uint32_t aux = 0) {
  Segment s;
  s.ip = at.ip;
  s.port = at.port;
  s.opcode = op;
  s.flags = flags;
  s.rkey = kKeyRW;
  s.aux = aux;
  s.addr = addr;
  return s;
}

Bytes ChainDatagram(uint64_t txn, uint32_t generation, const std::vector<Segment>& segs,
                    const Bytes& payload, uint8_t flags = 0) {
  Header h;
  h.opcode = Opcode::kChain;
  h.txn = txn;
  h.dtype = DType::kF32;
  h.redop = RedOp::kSum;
  h.flags = flags;
  h.length = static_cast<uint32_t>(payload.size());
  h.seg_count = static_cast<uint8_t>(segs.size());
  Bytes d(payload_offset(segs.size()) + payload.size());
  encode_header(h, d.data());
  SrPreamble sr;
  sr.generation = generation;
  encode_preamble(sr, d.data() + kHeaderSize);
  for (size_t i = 0; i < segs.size(); ++i)
    encode_segment(segs[i], d.data() + kHeaderSize + kSrPreambleSize + i * kSegmentSize);
  std::copy(payload.begin(), payload.end(), d.begin() + static_cast<ptrdiff_t>(payload_offset(segs.size())));
  return d;
}

// The gradient of three ranks summed along a chain (REDUCE_PAYLOAD at the
// first two devices) and applied by the device holding the parameters,
// which then stamps the generation: the offload pattern of a collective.
TEST_F(OptEngine, ChainEndsInOptStepWithStamp) {
  Dev d0, d1, d2;
  std::mt19937_64 rng(9);
  const size_t n = 32;
  std::vector<float> g0 = RandomFloats(n, rng), g1 = RandomFloats(n, rng), g2 = RandomFloats(n, rng);
  std::vector<float> p = RandomFloats(n, rng);
  d0.Put(0x200, g0);
  d1.Put(0x200, g1);
  d2.Put(0x800, p);
  std::fill(d2.mem.begin() + 0x1800, d2.mem.begin() + 0x1880, std::byte{0});
  OptimizerConfig c;
  c.momentum = 0.9;
  c.lr = 0.1;
  c.grad_scale = 1.0 / 3;
  c.state1_offset = 0x1000;
  Bytes rec(kOptConfigRecordSize);
  encode_opt_config(c, rec.data());
  Header ch;
  ch.opcode = Opcode::kOptConfig;
  ch.rkey = kKeyRW;
  ch.txn = 1;
  ch.length = kOptConfigRecordSize;
  ASSERT_EQ(d2.Send(kClient, Datagram(ch, rec)).status(), Status::kOk);

  const uint32_t kStampAux = 0x7000, kGen = 0x55;
  const Bytes d = ChainDatagram(600, kGen,
                                {Seg(kDev[0], Opcode::kReducePayload, 0x200), Seg(kDev[1], Opcode::kReducePayload, 0x200),
                                 Seg(kDev[2], Opcode::kOptStep, 0x800, kSegStamp, kStampAux)},
                                F32s(g2));
  Answer a0 = d0.Send(kClient, d);
  ASSERT_EQ(a0.kind, Action::Kind::kForward);
  Answer a1 = d1.Send(kDev[0], a0.wire);
  ASSERT_EQ(a1.kind, Action::Kind::kForward);
  const Bytes last_hop = a1.wire;
  Answer a2 = d2.Send(kDev[1], last_hop);
  ASSERT_EQ(a2.kind, Action::Kind::kReply);
  EXPECT_EQ(a2.status(), Status::kOk);
  EXPECT_EQ(a2.h.seg_index, 2);

  // What the device must have done: g = (g2 + g0) + g1, in the chain's order.
  Bytes sum = F32s(g2);
  reduce_reference(DType::kF32, RedOp::kSum, sum.data(), F32s(g0).data(), n);
  reduce_reference(DType::kF32, RedOp::kSum, sum.data(), F32s(g1).data(), n);
  Bytes want_p = F32s(p), want_buf(4 * n);
  optimizer_step(c, sum, want_p, want_buf, {});
  EXPECT_EQ(d2.At(0x800, n), Floats(want_p));
  EXPECT_EQ(d2.At(0x1800, n), Floats(want_buf));
  EXPECT_EQ(load_le<uint32_t>(d2.mem.data() + kStampAux), kGen);
  // The chain's answer carries the updated parameters (PROTOCOL 10.2).
  ASSERT_EQ(a2.h.length, 4 * n);
  EXPECT_EQ(Bytes(a2.wire.begin() + kHeaderSize, a2.wire.end()), want_p);

  // The last hop delivered twice (a duplicate on the link): applied once,
  // answered with the same parameters.
  Answer again = d2.Send(kDev[1], last_hop);
  EXPECT_EQ(again.status(), Status::kOk);
  EXPECT_EQ(d2.At(0x800, n), Floats(want_p));
  EXPECT_EQ(Bytes(again.wire.begin() + kHeaderSize, again.wire.end()), want_p);
  EXPECT_EQ(d2.Stat("replayed"), 1u);
}

TEST_F(OptEngine, ChainSegmentChecks) {
  OptimizerConfig c;
  c.lr = 1.0;
  ASSERT_EQ(Config(c), Status::kOk);
  d_.Put(0x100, {10.0f});
  // STAMP outside the region: refused before the step runs.
  Answer a = d_.Send(kClient, ChainDatagram(700, 1, {Seg(kDev[0], Opcode::kOptStep, 0x100, kSegStamp, kRwSize)},
                                            F32s({1.0f})));
  EXPECT_EQ(a.status(), Status::kBadSegment);
  EXPECT_EQ(d_.At(0x100, 1), (std::vector<float>{10.0f}));
  // dtype must be f32 in a chain too (the redop is the reducing segments').
  Bytes bad = ChainDatagram(701, 1, {Seg(kDev[0], Opcode::kOptStep, 0x100)}, F32s({1.0f}));
  store_be<uint8_t>(bad.data() + hdr::kDType, static_cast<uint8_t>(DType::kI32));
  EXPECT_EQ(d_.Send(kClient, bad).status(), Status::kBadType);
  // A sparse gradient, then the segment applies it and answers with the
  // parameters.
  Bytes g = F32s({0.0f, 0.0f, 0.0f, 2.0f});
  Bytes pairs(sparse_encoded_size(DType::kF32, g));
  sparse_encode(DType::kF32, g, pairs);
  Bytes sp = ChainDatagram(702, 1, {Seg(kDev[0], Opcode::kOptStep, 0x100)}, pairs, kFlagSparse);
  store_be<uint32_t>(sp.data() + hdr::kLength, 16);
  d_.Put(0x100, {1.0f, 2.0f, 3.0f, 4.0f});
  EXPECT_EQ(d_.Send(kClient, sp).status(), Status::kOk);
  EXPECT_EQ(d_.At(0x100, 4), (std::vector<float>{1.0f, 2.0f, 3.0f, 2.0f}));
}

}  // namespace
}  // namespace netdam::core

// ---------------------------------------------------------------- client

namespace netdam {
namespace {

using core::Bytes;
using transport::Endpoint;
using namespace std::chrono_literals;

const Endpoint kDeviceAddr{0x0A000001, 7000};
const Endpoint kClientAddr{0x0A000002, 40000};

struct FabricDev {
  FabricDev(transport::Fabric& f, size_t mem_size)
      : memory(mem_size), device(memory, core::DeviceConfig{0x77, {}}), engine(device),
        out(core::Engine::out_buffer_size(device.config())) {
    device.regions().add(core::Region{0, mem_size, 1, core::kPermAll});
    f.attach_handler(kDeviceAddr, [this](transport::InMsg& m, transport::Transport& self) {
      device::DeviceLoop::serve_one(engine, m, self, out);
    });
  }
  Bytes memory;
  core::Device device;
  core::Engine engine;
  Bytes out;
};

// A multi-packet step under 10% drop, duplication and reordering updates
// every parameter exactly once: the result equals one local application.
TEST(OptClient, MultiPacketStepUnderLossAppliesOnce) {
  transport::FaultModel m;
  m.drop = 0.1;
  m.duplicate = 0.1;
  m.reorder = 0.1;
  m.delay_min = 1us;
  m.delay_max = 20us;
  m.seed = 11;
  transport::Fabric fabric(m);
  FabricDev dev(fabric, 1 << 20);
  ClientOptions o;
  o.timeout = 30s;
  o.max_payload = 512;  // 128 floats a packet
  auto c = Client::connect(fabric.attach(kClientAddr), kDeviceAddr, o);
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  Client& client = *c.value();

  const size_t n = 4000;  // 32 packets, the last one partial
  std::mt19937_64 rng(21);
  std::vector<float> p = core::RandomFloats(n, rng);
  const uint64_t kParams = 0x10000, kS1 = 0x10000, kS2 = 0x20000;
  Bytes want_p = core::F32s(p), want_m(4 * n), want_v(4 * n);
  ASSERT_FALSE(client.write(kParams, want_p));
  ASSERT_FALSE(client.fill(kParams + kS1, 4 * n, std::vector<std::byte>{std::byte{0}}));
  ASSERT_FALSE(client.fill(kParams + kS2, 4 * n, std::vector<std::byte>{std::byte{0}}));
  const uint64_t before = client.counters().packets_sent;
  for (uint64_t t = 1; t <= 2; ++t) {
    OptimizerConfig cfg = core::Adam(t, OptimizerKind::kAdamW);
    cfg.state1_offset = kS1;
    cfg.state2_offset = kS2;
    ASSERT_FALSE(client.opt_config(cfg)) << t;
    Bytes g = core::F32s(core::RandomFloats(n, rng));
    Error e = client.opt_step(kParams, g);
    ASSERT_FALSE(e) << e.to_string();
    core::optimizer_step(cfg, g, want_p, want_m, want_v);
  }
  EXPECT_GE(client.counters().packets_sent - before, 2u * 33);
  EXPECT_GT(client.counters().retransmits, 0u);
  Bytes got(4 * n);
  ASSERT_FALSE(client.read(kParams, got));
  EXPECT_EQ(got, want_p);
  ASSERT_FALSE(client.read(kParams + kS1, got));
  EXPECT_EQ(got, want_m);
  ASSERT_FALSE(client.read(kParams + kS2, got));
  EXPECT_EQ(got, want_v);
}

// Client::chain_async takes OPT_STEP hops: a gradient summed at the device
// (REDUCE_PAYLOAD) and applied there, acknowledged without data.
TEST(OptClient, ChainWithOptStepHop) {
  transport::Fabric fabric;
  FabricDev dev(fabric, 1 << 16);
  auto c = Client::connect(fabric.attach(kClientAddr), kDeviceAddr);
  ASSERT_TRUE(c.ok());
  Client& client = *c.value();
  OptimizerConfig cfg;
  cfg.lr = 1.0;
  ASSERT_FALSE(client.opt_config(cfg));
  ASSERT_FALSE(client.write(0x100, core::F32s({10.0f, 20.0f})));  // parameters
  ASSERT_FALSE(client.write(0x200, core::F32s({1.0f, 2.0f})));    // a partial gradient
  const Hop hops[] = {Hop{kDeviceAddr.ip, kDeviceAddr.port, Opcode::kReducePayload, 0, 1, 0, 0x200},
                      Hop{kDeviceAddr.ip, kDeviceAddr.port, Opcode::kOptStep, kSegStamp, 1, 0x300, 0x100}};
  const Bytes grad = core::F32s({0.5f, 0.5f});
  Op op = client.chain_async(hops, 9, DType::kF32, RedOp::kSum, 8, grad);
  Error e = client.wait(op);
  ASSERT_FALSE(e) << e.to_string();
  Bytes got(8);
  ASSERT_FALSE(client.read(0x100, got));
  EXPECT_EQ(core::Floats(got), (std::vector<float>{8.5f, 17.5f}));
  EXPECT_EQ(core::load_le<uint32_t>(dev.memory.data() + 0x300), 9u);
}

TEST(OptClient, ArgumentsAndNaks) {
  transport::Fabric fabric;
  FabricDev dev(fabric, 1 << 16);
  auto c = Client::connect(fabric.attach(kClientAddr), kDeviceAddr);
  ASSERT_TRUE(c.ok());
  Client& client = *c.value();
  Bytes three(3);
  EXPECT_EQ(client.opt_step(0, three).code(), Error::Code::kInvalidArgument);
  Error e = client.opt_step(0, Bytes(8));
  EXPECT_EQ(e.code(), Error::Code::kNak);
  EXPECT_EQ(e.status(), Status::kNoOptimizer);
  ASSERT_FALSE(client.opt_config(OptimizerConfig{}));
  EXPECT_FALSE(client.opt_step(0, Bytes(8)));
  EXPECT_FALSE(client.opt_step(0, {}));  // nothing to do
}

}  // namespace
}  // namespace netdam
