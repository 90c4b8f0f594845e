// Errors as values (cheap on success), and Result<T> = a T or an Error.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "netdam/types.h"

namespace netdam {

class Error {
 public:
  enum class Code : uint8_t {
    kOk = 0,
    kTimeout,          // no answer within the deadline despite retransmission
    kNak,              // the device refused the request; see status()
    kRestarted,        // the device's boot id changed: its memory is gone
    kInvalidArgument,  // caught before anything was sent
    kTransport,        // socket error, unresolvable address, ...
    kProtocol,         // the device answered something malformed
  };

  Error() = default;
  static Error ok() { return {}; }
  static Error timeout(std::string msg) { return {Code::kTimeout, Status::kOk, std::move(msg)}; }
  static Error nak(Status s, std::string msg) { return {Code::kNak, s, std::move(msg)}; }
  static Error restarted(std::string msg) { return {Code::kRestarted, Status::kOk, std::move(msg)}; }
  static Error invalid(std::string msg) { return {Code::kInvalidArgument, Status::kOk, std::move(msg)}; }
  static Error transport(std::string msg) { return {Code::kTransport, Status::kOk, std::move(msg)}; }
  static Error protocol(std::string msg) { return {Code::kProtocol, Status::kOk, std::move(msg)}; }

  bool is_ok() const { return code_ == Code::kOk; }
  explicit operator bool() const { return !is_ok(); }  // true when there IS an error
  Code code() const { return code_; }
  Status status() const { return status_; }  // the device's status for kNak
  const std::string& message() const { return message_; }
  std::string to_string() const;
  // The same error (code, status) with `prefix` put before its message.
  Error prefixed(std::string_view prefix) const { return {code_, status_, std::string(prefix) + message_}; }
  Error suffixed(std::string_view suffix) const { return {code_, status_, message_ + std::string(suffix)}; }

 private:
  Error(Code c, Status s, std::string m) : code_(c), status_(s), message_(std::move(m)) {}
  Code code_ = Code::kOk;
  Status status_ = Status::kOk;
  std::string message_;
};

std::string_view to_string(Error::Code c);

template <typename T>
class Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Error e) : v_(std::move(e)) {}      // NOLINT
  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  const T& value() const& { return std::get<0>(v_); }
  T& operator*() & { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  const Error& error() const {
    static const Error kNone;
    return ok() ? kNone : std::get<1>(v_);
  }

 private:
  std::variant<T, Error> v_;
};

}  // namespace netdam
