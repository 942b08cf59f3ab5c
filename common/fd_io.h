// Socket I/O with file-descriptor passing (SCM_RIGHTS) and deadlines. Shared by ringd and
// libringd-client. Every function returns 0/-errno style results, never throws.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include "common/unique_fd.h"
#include "proto/result.h"

namespace ringd {

using Clock = std::chrono::steady_clock;

// Most fds ringd ever passes in one message; anything more is an error (MSG_CTRUNC).
inline constexpr int kMaxPassedFds = 4;

// Sends all of `bytes`, attaching `fds` to the first byte. Blocking sockets only, or
// non-blocking ones whose buffer is known to have room (a fresh connection).
Status send_all(int sock, std::span<const uint8_t> bytes, std::span<const int> fds = {});

// One recvmsg: appends received fds to `fds` (at most kMaxPassedFds; a truncated control
// message closes what arrived and returns -EMSGSIZE). Returns bytes read, 0 on EOF, or -errno.
ssize_t recv_some(int sock, uint8_t *buf, size_t len, std::vector<UniqueFd> &fds);

// Reads exactly `len` bytes before `deadline`, polling the socket; fds are collected.
Status recv_exact(int sock, uint8_t *buf, size_t len, Clock::time_point deadline, std::vector<UniqueFd> &fds);

// Milliseconds left until `deadline` for poll(): 0 when past, capped at INT_MAX.
int ms_until(Clock::time_point deadline);

std::string errno_string(int err);  // strerror for a positive or negative errno

}  // namespace ringd
