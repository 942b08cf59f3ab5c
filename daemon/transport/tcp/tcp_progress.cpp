// linux/tcp.h's struct tcp_info (glibc's netinet/tcp.h, which the rest of the transport uses,
// stops before tcpi_snd_wnd); the two cannot share a translation unit.
#include "daemon/transport/tcp/tcp_progress.h"

#include <linux/tcp.h>
#include <sys/socket.h>

#include <cstddef>

namespace ringd {

constexpr int kTcpLevel = 6;  // IPPROTO_TCP (netinet/in.h, which does not go with linux/tcp.h here)

bool tcp_progress(int fd, TcpProgress &out) {
    tcp_info info{};
    socklen_t len = sizeof info;
    if (::getsockopt(fd, kTcpLevel, TCP_INFO, &info, &len) != 0) return false;
    if (len < offsetof(tcp_info, tcpi_last_ack_recv) + sizeof info.tcpi_last_ack_recv) return false;
    out.unacked = info.tcpi_unacked;
    out.last_ack_ms = info.tcpi_last_ack_recv;
    out.have_window = len >= offsetof(tcp_info, tcpi_snd_wnd) + sizeof info.tcpi_snd_wnd;
    out.peer_window = out.have_window ? info.tcpi_snd_wnd : 0;
    return true;
}

}  // namespace ringd
