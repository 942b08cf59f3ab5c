// TCP helpers for tests: connected pairs over 127.0.0.1, and connections from a chosen source
// address (127.0.0.0/8 gives every test as many "machines" as it needs).
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <utility>

#include <catch2/catch.hpp>

#include "common/unique_fd.h"

namespace ringd::test {

// A connected pair of TCP sockets over 127.0.0.1 (client, accepted server side).
inline std::pair<UniqueFd, UniqueFd> tcp_pair(bool nonblocking = false) {
    UniqueFd lst(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    REQUIRE(::bind(lst.get(), reinterpret_cast<sockaddr *>(&a), sizeof a) == 0);
    REQUIRE(::listen(lst.get(), 1) == 0);
    REQUIRE(::getsockname(lst.get(), reinterpret_cast<sockaddr *>(&a), &len) == 0);
    UniqueFd c(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    REQUIRE(::connect(c.get(), reinterpret_cast<sockaddr *>(&a), sizeof a) == 0);  // loopback: completes at once
    UniqueFd s(::accept4(lst.get(), nullptr, nullptr, SOCK_CLOEXEC));
    REQUIRE(s.valid());
    if (nonblocking)
        for (int fd : {c.get(), s.get()}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    return {std::move(c), std::move(s)};
}

// A connection to 127.0.0.1:port whose source address is `src` (e.g. "127.0.0.9").
inline UniqueFd connect_from(const char *src, uint16_t port) {
    UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    ::inet_pton(AF_INET, src, &a.sin_addr);
    REQUIRE(::bind(s.get(), reinterpret_cast<sockaddr *>(&a), sizeof a) == 0);
    a.sin_port = htons(port);
    ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    REQUIRE(::connect(s.get(), reinterpret_cast<sockaddr *>(&a), sizeof a) == 0);
    return s;
}

}  // namespace ringd::test
