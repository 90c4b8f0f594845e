// A minimal Redis client (RESP2) for `netdam-bench pool`: SET and GET of
// binary values, pipelined, on a nonblocking socket driven by the caller's
// poll(2) loop.
//
// Why not hiredis: the benchmark needs two commands and two reply types,
// and wants the client side of Redis to cost no more than netdam's client
// does: commands go out with writev straight from the caller's value buffer
// (no copy into an output buffer) and a GET's value is handed to the
// caller as a view into the receive buffer (no allocation per reply, where
// hiredis builds a redisReply object per reply). So the figures measure
// Redis, not a heavier client. RESP is specified in the Redis docs
// ("Redis serialization protocol specification").
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace netdam::bench {

class RespConnection {
 public:
  // One reply. kind: '+' simple string, '-' error, '$' bulk ('$' with
  // null = true for a missing key), ':' integer. data: the string / bulk
  // bytes (valid until the next call that reads).
  struct Reply {
    char kind = 0;
    bool null = false;
    std::span<const std::byte> data;
  };

  // Blocking TCP connect to 127.0.0.1-style "HOST:PORT" (IPv4 literal),
  // then nonblocking with TCP_NODELAY. nullptr and `error` on failure.
  static std::unique_ptr<RespConnection> connect(const std::string& host_port, std::string& error);
  ~RespConnection();
  RespConnection(const RespConnection&) = delete;
  RespConnection& operator=(const RespConnection&) = delete;

  int fd() const { return fd_; }
  // Queue a command; `value` must stay alive until flush() has sent it.
  void set(std::string_view key, std::span<const std::byte> value);
  void get(std::string_view key);
  // Any other command, as plain words (e.g. {"FLUSHALL"}).
  void command(const std::vector<std::string>& words);
  bool want_write() const { return !out_.empty(); }
  // Sends what the socket takes now; false on a socket error.
  bool flush();
  // Reads what is there now and calls on_reply(reply) for every complete
  // reply, in order; false on EOF, a socket error or a malformed reply.
  template <typename F>
  bool receive(F&& on_reply) {
    if (!fill()) return false;
    Reply r;
    size_t used = 0;
    while ((used = parse(r)) > 0) {
      on_reply(r);
      consumed_ += used;
    }
    return !bad_;
  }
  // Blocking helpers for setup and checks: sends, then waits for one reply.
  bool call(const std::vector<std::string>& words, std::string* answer = nullptr);

 private:
  explicit RespConnection(int fd) : fd_(fd) {}
  bool fill();
  size_t parse(Reply& r);  // bytes of one complete reply at consumed_, 0 if incomplete

  struct Chunk {
    std::string own;                    // header text (or whole command)
    std::span<const std::byte> value;   // then these bytes, then "\r\n"
    size_t sent = 0;                    // bytes of this chunk already sent
    size_t size() const { return own.size() + (value.empty() ? 0 : value.size() + 2); }
  };
  int fd_;
  std::deque<Chunk> out_;
  std::vector<std::byte> in_;
  size_t have_ = 0, consumed_ = 0;
  bool bad_ = false;
};

}  // namespace netdam::bench
