// Point-to-point messages (torch's send/recv) as one-sided puts into the
// receiver's device, with a stamp (docs/TORCH.md, "send and recv").
//
// Every rank has, in its device's control region (control.h), one mailbox
// of M bytes per sender. A message travels in pieces of at most M bytes:
//
//   sender r, piece with sequence number s (per pair, from 1):
//     1. wait until ack[j] on its own device is s-1 (j took piece s-1 out)
//     2. WRITE the piece into mailbox[r] of device j (chains of one hop,
//        one per packet), and wait for their answers
//     3. WRITE the header (length, tag, offset) into header[r] of device j,
//        STAMP s: the device stores the stamp after the header
//   receiver j:
//     4. wait until header[r]'s stamp on its own device is s
//     5. copy the piece out (a memcpy from the mapped device, or a READ)
//     6. WRITE ack[j] on device r, STAMP s
//
// A send completes when its last header is stored (the data is in the
// receiver's device, as gloo's send completes when the data has left), so
// a send never waits for the matching recv unless the message is longer
// than M. Messages of one pair arrive in order; a recv whose tag or size
// differs from the next message's fails with an error that says so.
// Sends to different ranks, and recvs from different ranks, run at once. A
// recv from any source takes the first message that is there from a rank
// with no recv of its own waiting, and from then on is a recv from it.
//
// Driven by the Runner's thread through the Group's client (one thread).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "bindings/torch/control.h"
#include "netdam/client.h"
#include "netdam/error.h"

namespace netdam::torch_backend {

class Mailboxes {
 public:
  // `devices`: every rank's device (ip, port); `local`: this rank's device
  // memory if mapped (empty: over the network); `block`: payload bytes per
  // packet.
  Mailboxes(Client& client, std::vector<Hop> devices, int rank, const ControlLayout& control,
            std::span<std::byte> local, size_t block);
  ~Mailboxes();

  void send(int peer, int64_t tag, std::span<const std::byte> data, std::function<void(const Error&)> done);
  void recv(int peer, int64_t tag, std::span<std::byte> out, std::function<void(const Error&)> done);
  // A recv from whichever rank's next message is there first (among the
  // ranks with no recv of their own waiting); `source` learns that rank
  // before `done` runs. Needs this rank's device memory mapped.
  void recv_any(int64_t tag, std::span<std::byte> out, std::function<void(int)> source,
                std::function<void(const Error&)> done);
  // Advances every message without blocking; true if any advanced.
  bool progress();
  bool busy() const;
  // Some message waits for an answer from the network (not only for a
  // stamp that another rank writes).
  bool waiting_on_network() const;
  // Completes every message in progress with `e` (the group is gone).
  void fail_all(const Error& e);

 private:
  struct Send;
  struct Recv;
  bool step(Send& s);
  bool step(Recv& r);
  bool take_header(Recv& r);
  // The u32 stamp at `aux` of this rank's control region: from the mapping,
  // or by a READ (`op`, into `word`); nullopt while the READ is under way.
  std::optional<uint32_t> stamp(uint32_t aux, Op& op, std::array<std::byte, 4>& word);

  Client& client_;
  std::vector<Hop> devices_;
  int rank_;
  ControlLayout control_;
  std::span<std::byte> local_;
  size_t block_;
  std::vector<uint32_t> sent_, taken_;  // per peer: last sequence number sent / taken out
  std::vector<std::deque<std::unique_ptr<Send>>> sends_;  // per peer, in order
  std::vector<std::deque<std::unique_ptr<Recv>>> recvs_;
  std::deque<std::unique_ptr<Recv>> any_;  // recv_any, not yet bound to a rank
  size_t next_any_ = 0;                    // where the next search for a message starts
};

}  // namespace netdam::torch_backend
