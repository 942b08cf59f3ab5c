// What the kernel says of a TCP connection's sending side (TCP_INFO, with the fields glibc's
// struct tcp_info lacks), for telling a path that is gone from a peer that is slow to read.
#pragma once

#include <cstdint>

namespace ringd {

struct TcpProgress {
    uint32_t unacked = 0;        // segments sent and not acknowledged
    uint32_t last_ack_ms = 0;    // since the last acknowledgement came in
    uint32_t peer_window = 0;    // the peer's receive window, as it last advertised it (bytes)
    bool have_window = false;    // (kernels from 5.4 say it)
};

// False when the socket is not TCP (a socketpair) or the kernel says nothing.
bool tcp_progress(int fd, TcpProgress &out);

}  // namespace ringd
