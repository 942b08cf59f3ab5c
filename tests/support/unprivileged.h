// Runs a function in a forked child that has dropped to another identity (by default nobody:
// uid/gid 65534, no supplementary groups, no capabilities left), as a daemon started without root
// or a trainer of another user would be, and hands back the string it returned.
#pragma once

#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <exception>
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
        if (::setgroups(who.groups.size(), who.groups.data()) == 0 && ::setgid(who.gid) == 0 && ::setuid(who.uid) == 0) {
            try {  // nothing may unwind into the test's own code in this child
                msg = f();
            } catch (const std::exception &e) {
                msg = std::string("exception in the child: ") + e.what();
            }
        }
        else if (::getuid() == 0)
            msg = "cannot drop to uid " + std::to_string(who.uid);
        (void)!::write(fds[1], msg.data(), msg.size());
        ::_exit(0);
    }
    ::close(fds[1]);
    // The child's answer within a minute (what it runs has deadlines of its own); a child that
    // overstays is killed and said to have hung.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    std::string msg;
    char buf[512];
    bool hung = false;
    for (;;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        pollfd p{fds[0], POLLIN, 0};
        if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) {
            hung = true;
            break;
        }
        const ssize_t k = ::read(fds[0], buf, sizeof buf);
        if (k <= 0) break;
        msg.append(buf, static_cast<size_t>(k));
    }
    ::close(fds[0]);
    if (hung) ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    if (hung) return "the child running as uid " + std::to_string(who.uid) + " did not answer within 60 s";
    if (msg == "\x01skip") return std::nullopt;
    return msg;
}

template <class F>
std::optional<std::string> run_as_nobody(F &&f) {
    return run_as(Identity{}, std::forward<F>(f));
}

}  // namespace ringd::test
