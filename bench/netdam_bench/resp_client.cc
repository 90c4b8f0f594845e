#include "resp_client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>

namespace netdam::bench {

namespace {
constexpr char kCrlf[2] = {'\r', '\n'};
}

std::unique_ptr<RespConnection> RespConnection::connect(const std::string& host_port, std::string& error) {
  const size_t colon = host_port.rfind(':');
  sockaddr_in a{};
  a.sin_family = AF_INET;
  if (colon == std::string::npos || inet_pton(AF_INET, host_port.substr(0, colon).c_str(), &a.sin_addr) != 1) {
    error = "bad redis address " + host_port;
    return nullptr;
  }
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(host_port.substr(colon + 1))));
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    error = "connect " + host_port + ": " + std::strerror(errno);
    if (fd >= 0) close(fd);
    return nullptr;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  auto c = std::unique_ptr<RespConnection>(new RespConnection(fd));
  c->in_.resize(1u << 20);
  return c;
}

RespConnection::~RespConnection() {
  if (fd_ >= 0) close(fd_);
}

void RespConnection::set(std::string_view key, std::span<const std::byte> value) {
  Chunk c;
  c.own = "*3\r\n$3\r\nSET\r\n$" + std::to_string(key.size()) + "\r\n" + std::string(key) + "\r\n$" +
          std::to_string(value.size()) + "\r\n";
  c.value = value;
  if (value.empty()) c.own += "\r\n";
  out_.push_back(std::move(c));
}

void RespConnection::get(std::string_view key) {
  Chunk c;
  c.own = "*2\r\n$3\r\nGET\r\n$" + std::to_string(key.size()) + "\r\n" + std::string(key) + "\r\n";
  out_.push_back(std::move(c));
}

void RespConnection::command(const std::vector<std::string>& words) {
  Chunk c;
  c.own = "*" + std::to_string(words.size()) + "\r\n";
  for (const auto& w : words) c.own += "$" + std::to_string(w.size()) + "\r\n" + w + "\r\n";
  out_.push_back(std::move(c));
}

bool RespConnection::flush() {
  while (!out_.empty()) {
    iovec iov[48];
    int n = 0;
    for (auto it = out_.begin(); it != out_.end() && n + 3 <= 48; ++it) {
      // The chunk as up to three pieces (header, value, CRLF), skipping
      // what an earlier partial write already sent.
      size_t skip = it->sent;
      auto add = [&](const void* p, size_t len) {
        if (skip >= len) {
          skip -= len;
          return;
        }
        iov[n++] = iovec{const_cast<char*>(static_cast<const char*>(p)) + skip, len - skip};
        skip = 0;
      };
      add(it->own.data(), it->own.size());
      if (!it->value.empty()) {
        add(it->value.data(), it->value.size());
        add(kCrlf, 2);
      }
    }
    const ssize_t w = writev(fd_, iov, n);
    if (w < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    size_t left = static_cast<size_t>(w);
    while (left > 0 && !out_.empty()) {
      Chunk& c = out_.front();
      const size_t rest = c.size() - c.sent;
      if (left >= rest) {
        left -= rest;
        out_.pop_front();
      } else {
        c.sent += left;
        left = 0;
      }
    }
  }
  return true;
}

bool RespConnection::fill() {
  if (consumed_ > 0) {  // compact: move the unparsed tail to the front
    std::memmove(in_.data(), in_.data() + consumed_, have_ - consumed_);
    have_ -= consumed_;
    consumed_ = 0;
  }
  for (;;) {
    if (have_ == in_.size()) in_.resize(in_.size() * 2);
    const ssize_t r = ::recv(fd_, in_.data() + have_, in_.size() - have_, 0);
    if (r > 0) {
      have_ += static_cast<size_t>(r);
      if (have_ < in_.size()) return true;  // drained what was there
      continue;
    }
    if (r == 0) return false;
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  }
}

size_t RespConnection::parse(Reply& r) {
  const char* p = reinterpret_cast<const char*>(in_.data()) + consumed_;
  const size_t n = have_ - consumed_;
  const void* eol = std::memchr(p, '\r', n);
  if (!eol) return 0;
  const size_t line = static_cast<size_t>(static_cast<const char*>(eol) - p);
  if (line + 2 > n) return 0;
  r = Reply{};
  r.kind = p[0];
  switch (r.kind) {
    case '+':
    case '-':
    case ':':
      r.data = std::as_bytes(std::span(p + 1, line - 1));
      return line + 2;
    case '$': {
      long long len = 0;
      auto [end, ec] = std::from_chars(p + 1, p + line, len);
      if (ec != std::errc() || end != p + line || len < -1) break;
      if (len == -1) {
        r.null = true;
        return line + 2;
      }
      const size_t total = line + 2 + static_cast<size_t>(len) + 2;
      if (total > n) {
        if (total > in_.size()) in_.resize(total + consumed_);  // room for the whole reply
        return 0;
      }
      r.data = std::as_bytes(std::span(p + line + 2, static_cast<size_t>(len)));
      return total;
    }
    default:
      break;
  }
  bad_ = true;
  return 0;
}

bool RespConnection::call(const std::vector<std::string>& words, std::string* answer) {
  command(words);
  bool got = false, ok = false;
  while (!got) {
    if (!flush()) return false;
    pollfd pfd{fd_, static_cast<short>(POLLIN | (want_write() ? POLLOUT : 0)), 0};
    if (::poll(&pfd, 1, 5000) <= 0) return false;
    if (!receive([&](const Reply& r) {
          got = true;
          ok = r.kind != '-';
          if (answer) answer->assign(reinterpret_cast<const char*>(r.data.data()), r.data.size());
        }))
      return false;
  }
  return ok;
}

}  // namespace netdam::bench
