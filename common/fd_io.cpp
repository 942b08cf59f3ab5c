#include "common/fd_io.h"

#include <poll.h>
#include <sys/socket.h>

#include <climits>
#include <cstring>
#include <string>

namespace ringd {

std::string errno_string(int err) { return std::strerror(err < 0 ? -err : err); }

int ms_until(Clock::time_point deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return 0;
    return left > INT_MAX ? INT_MAX : static_cast<int>(left);
}

Status send_all(int sock, std::span<const uint8_t> bytes, std::span<const int> fds) {
    if (fds.size() > static_cast<size_t>(kMaxPassedFds)) return make_error(-E2BIG, "too many fds to pass");
    size_t sent = 0;
    bool fds_pending = !fds.empty();
    while (sent < bytes.size() || fds_pending) {
        iovec iov{const_cast<uint8_t *>(bytes.data() + sent), bytes.size() - sent};
        msghdr msg{};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPassedFds)] = {};
        if (fds_pending) {
            msg.msg_control = control;
            msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
            cmsghdr *c = CMSG_FIRSTHDR(&msg);
            c->cmsg_level = SOL_SOCKET;
            c->cmsg_type = SCM_RIGHTS;
            c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
            std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
        }
        const ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            const int e = errno;
            return make_error(-e, std::string("send: ") + std::strerror(e));
        }
        fds_pending = false;
        sent += static_cast<size_t>(n);
    }
    return Ok{};
}

ssize_t recv_some(int sock, uint8_t *buf, size_t len, std::vector<UniqueFd> &fds) {
    iovec iov{buf, len};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPassedFds)];
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t n;
    do {
        n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    if (n < 0) return -errno;
    bool extra = false;
    for (cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const size_t nfds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < nfds; ++i) {
            int fd;
            std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            fds.emplace_back(fd);  // owned now, closed by whoever drops the vector
        }
        extra = extra || fds.size() > static_cast<size_t>(kMaxPassedFds);
    }
    if ((msg.msg_flags & MSG_CTRUNC) || extra) {
        fds.clear();
        return -EMSGSIZE;
    }
    return n;
}

Status recv_exact(int sock, uint8_t *buf, size_t len, Clock::time_point deadline, std::vector<UniqueFd> &fds) {
    size_t got = 0;
    while (got < len) {
        pollfd p{sock, POLLIN, 0};
        const int r = ::poll(&p, 1, ms_until(deadline));
        if (r < 0) {
            if (errno == EINTR) continue;
            return make_error(-errno, std::string("poll: ") + std::strerror(errno));
        }
        if (r == 0) return make_error(-ETIMEDOUT, "timed out waiting for ringd");
        const ssize_t n = recv_some(sock, buf + got, len - got, fds);
        if (n == -EAGAIN) continue;
        if (n < 0) return make_error(static_cast<int>(n), "receive: " + errno_string(static_cast<int>(n)));
        if (n == 0) return make_error(-ECONNRESET, "ringd closed the connection");
        got += static_cast<size_t>(n);
    }
    return Ok{};
}

}  // namespace ringd
