// Runs a function in a forked child that has dropped to nobody (uid/gid 65534: no capabilities
// left), as a daemon started without root would be, and hands back the string it returned.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <optional>
#include <string>

namespace ringd::test {

// nullopt when this process cannot drop privileges (not root): the caller skips.
template <class F>
std::optional<std::string> run_as_nobody(F &&f) {
    int fds[2];
    if (::pipe(fds) != 0) return std::string("pipe failed");
    const pid_t pid = ::fork();
    if (pid < 0) return std::string("fork failed");
    if (pid == 0) {
        ::close(fds[0]);
        std::string msg = "\x01skip";
        if (::setgid(65534) == 0 && ::setuid(65534) == 0) msg = f();
        else if (::getuid() == 0) msg = "cannot drop to nobody";
        (void)!::write(fds[1], msg.data(), msg.size());
        ::_exit(0);
    }
    ::close(fds[1]);
    std::string msg;
    char buf[512];
    for (ssize_t k; (k = ::read(fds[0], buf, sizeof buf)) > 0;) msg.append(buf, static_cast<size_t>(k));
    ::close(fds[0]);
    ::waitpid(pid, nullptr, 0);
    if (msg == "\x01skip") return std::nullopt;
    return msg;
}

}  // namespace ringd::test
