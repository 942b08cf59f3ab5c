// Result<T>: a value or an error (negative errno + message). Used across proto/, the daemon and
// the client library so that no exception ever has to cross a process or C ABI boundary.
#pragma once

#include <cerrno>
#include <string>
#include <utility>
#include <variant>

namespace ringd {

struct Error {
    int code = -EINVAL;  // negative errno
    std::string message;
};

template <typename T>
class [[nodiscard]] Result {
public:
    Result(T value) : v_(std::move(value)) {}            // NOLINT: implicit by design
    Result(Error error) : v_(std::move(error)) {}        // NOLINT: implicit by design

    bool ok() const { return v_.index() == 0; }
    explicit operator bool() const { return ok(); }
    T &value() { return std::get<0>(v_); }
    const T &value() const { return std::get<0>(v_); }
    T &operator*() { return value(); }
    const T &operator*() const { return value(); }
    T *operator->() { return &value(); }
    const T *operator->() const { return &value(); }
    const Error &error() const { return std::get<1>(v_); }

private:
    std::variant<T, Error> v_;
};

// Result<void> equivalent.
struct Ok {};
using Status = Result<Ok>;

inline Error make_error(int code, std::string message) { return Error{code, std::move(message)}; }

}  // namespace ringd
