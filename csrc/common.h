// Shared error type and small helpers of the KV-passthrough I/O engine.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kvio {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kHugePage = 2 * kMiB;

// Which Python exception class an Error becomes (see bindings.cc).
// Unavailable: the device lost its connection or is marked failed (retry later, data not lost).
enum class ErrorKind { Io, Alignment, PoolFull, Corrupt, Value, Unavailable };

// errnos with which a backend reports I/O that failed because the device is unavailable.
inline bool unavailable_errno(int err) {
  return err == ECONNRESET || err == ENOTCONN || err == ENODEV;
}

// Every failure of the engine carries the device, the offset and errno, so the Python side can
// raise KvioError(errno, message) with .device/.offset set.
class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string device, int64_t offset, int err, const std::string& what)
      : std::runtime_error(what), kind_(kind), device_(std::move(device)), offset_(offset),
        err_(err) {}
  ErrorKind kind() const { return kind_; }
  const std::string& device() const { return device_; }
  int64_t offset() const { return offset_; }
  int err() const { return err_; }

 private:
  ErrorKind kind_;
  std::string device_;
  int64_t offset_;
  int err_;
};

inline std::string errno_text(int err) {
  char buf[128];
  // GNU strerror_r returns the message pointer (may not use buf).
  return std::string(strerror_r(err, buf, sizeof(buf)));
}

// "device '/dev/loop3': read at offset 4096 (8192 bytes): Input/output error"
inline std::string describe(const std::string& device, const char* what, int64_t offset,
                            uint64_t length, const std::string& detail) {
  std::string s = "device '" + device + "': " + what;
  if (offset >= 0) s += " at offset " + std::to_string(offset);
  if (length) s += " (" + std::to_string(length) + " bytes)";
  return s + ": " + detail;
}

[[noreturn]] inline void throw_errno(const std::string& device, const char* what, int64_t offset,
                                     uint64_t length, int err) {
  throw Error(ErrorKind::Io, device, offset, err,
              describe(device, what, offset, length, errno_text(err)));
}

inline bool is_pow2(uint64_t x) { return x && !(x & (x - 1)); }
inline uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace kvio
