// Runs a function in a forked child that has dropped to another identity (by default nobody:
// uid/gid 65534, no supplementary groups, no capabilities left), as a daemon started without root
// or a trainer of another user would be, and hands back the string it returned.
#pragma once

#include <grp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ringd::test {

struct Identity {
    uid_t uid = 65534;
    gid_t gid = 65534;
    std::vector<gid_t> groups;  // supplementary groups; root's own (gid 0 and others) are dropped
};

// nullopt when this process cannot change identity (not root): the caller skips.
template <class F>
std::optional<std::string> run_as(const Identity &who, F &&f) {
    int fds[2];
    if (::pipe(fds) != 0) return std::string("pipe failed");
    const pid_t pid = ::fork();
    if (pid < 0) return std::string("fork failed");
    if (pid == 0) {
        ::close(fds[0]);
        std::string msg = "\x01skip";
        if (::setgroups(who.groups.size(), who.groups.data()) == 0 && ::setgid(who.gid) == 0 && ::setuid(who.uid) == 0)
            msg = f();
        else if (::getuid() == 0)
            msg = "cannot drop to uid " + std::to_string(who.uid);
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

template <class F>
std::optional<std::string> run_as_nobody(F &&f) {
    return run_as(Identity{}, std::forward<F>(f));
}

}  // namespace ringd::test
