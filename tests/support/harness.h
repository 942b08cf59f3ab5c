// Test harness: a real ringd process with a generated config in a temp dir, started and
// stopped with deadlines (READY=1 read from a NOTIFY_SOCKET the test owns, pidfd for exit),
// and trainer processes forked from the test. No sleeps: every wait is on an fd.
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <sys/stat.h>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "common/fd_io.h"
#include "common/unique_fd.h"

namespace ringd::test {

inline std::string env_or(const char *name, const char *fallback) {
    const char *v = std::getenv(name);
    return v ? v : fallback;
}

// Temp dirs made by this process, removed (with what is in them) when it exits normally; forked
// children end with _exit and leave them to their parent.
class TempDirs {
public:
    static TempDirs &get() {
        static TempDirs t;
        return t;
    }
    std::string make() {
        char tmpl[] = "/tmp/ringd-test.XXXXXX";
        if (!::mkdtemp(tmpl)) {
            std::perror("mkdtemp");
            std::abort();  // a test without its directory would write somewhere it does not own
        }
        dirs_.emplace_back(tmpl);
        return tmpl;
    }
    ~TempDirs() {
        if (::getpid() != owner_) return;
        std::error_code ec;
        for (const auto &d : dirs_) std::filesystem::remove_all(d, ec);
    }

private:
    TempDirs() : owner_(::getpid()) {}
    pid_t owner_;
    std::vector<std::string> dirs_;
};

inline std::string make_temp_dir() { return TempDirs::get().make(); }

// A fresh ring secret (mode 0600) and the config keys that use it: multi-host daemons refuse to
// start without one.
inline std::string secret_yaml(uid_t owner = 0, gid_t group = 0) {
    const std::string dir = make_temp_dir(), path = dir + "/secret";
    std::ofstream(path) << std::hex << std::random_device{}() << std::random_device{}() << "0123456789abcdef\n";
    ::chmod(path.c_str(), 0600);
    if (owner != 0) {  // for daemons running as that user
        (void)!::chown(dir.c_str(), owner, group);
        (void)!::chown(path.c_str(), owner, group);
    }
    return "auth: {secret_file: " + path + "}\n";
}

inline std::string read_file(const std::string &path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

inline int pidfd_open(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

// Waits for `pid` (a child) to exit within `timeout`; returns its wait status, or -1 on timeout.
inline int wait_child(pid_t pid, std::chrono::milliseconds timeout) {
    int status = 0;
    UniqueFd pfd(pidfd_open(pid));
    if (pfd) {
        pollfd p{pfd.get(), POLLIN, 0};
        if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return -1;
        return ::waitpid(pid, &status, 0) == pid ? status : -1;
    }
    // No pidfd (an old kernel): ask every 10 ms until the deadline.
    for (const auto deadline = std::chrono::steady_clock::now() + timeout;;) {
        const pid_t r = ::waitpid(pid, &status, WNOHANG);
        if (r == pid) return status;
        if (r < 0 || std::chrono::steady_clock::now() >= deadline) return -1;
        ::poll(nullptr, 0, 10);
    }
}

// A datagram socket that receives sd_notify messages.
class NotifySocket {
public:
    NotifySocket() {
        path_ = make_temp_dir() + "/notify.sock";
        fd_ = UniqueFd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
        sockaddr_un a{};
        a.sun_family = AF_UNIX;
        std::strcpy(a.sun_path, path_.c_str());
        (void)!::bind(fd_.get(), reinterpret_cast<sockaddr *>(&a), sizeof a);
    }
    const std::string &path() const { return path_; }
    // Lets a daemon running as another user send to it.
    void open_to_everyone() {
        (void)!::chmod(path_.substr(0, path_.rfind('/')).c_str(), 0711);
        (void)!::chmod(path_.c_str(), 0666);
    }
    // Next message within the timeout, or "" on timeout.
    std::string next(std::chrono::milliseconds timeout) {
        pollfd p{fd_.get(), POLLIN, 0};
        if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return "";
        char buf[4096];
        const ssize_t n = ::recv(fd_.get(), buf, sizeof buf, 0);
        return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
    }
    // Waits until a message containing `what` arrives.
    bool wait_for(const std::string &what, std::chrono::milliseconds timeout) {
        const auto deadline = Clock::now() + timeout;
        while (Clock::now() < deadline) {
            const std::string m = next(std::chrono::milliseconds(ms_until(deadline)));
            if (m.find(what) != std::string::npos) return true;
        }
        return false;
    }

private:
    std::string path_;
    UniqueFd fd_;
};

struct DaemonOptions {
    std::string host = "node0";
    std::string hosts_yaml;  // the hosts list; empty: just node0 on 127.0.0.1:7400
    std::string extra_yaml;  // appended to the generated config
    std::string op_timeout = "5s";
    std::string slot_bytes = "64MiB";
    int max_slots = 16;
    std::vector<std::string> env;  // extra KEY=VALUE
    int nofile = 0;                 // RLIMIT_NOFILE for the daemon (soft = hard), 0: inherit
    uid_t uid = 0;                  // run the daemon as this uid/gid (no supplementary groups); 0: as the test
    gid_t gid = 0;
    std::string bin;                // the ringd to run; empty: $RINGD_BIN
    std::string netns;              // the network namespace it runs in (tests/support/netns.h); empty: this one
    std::vector<int> cpus;          // the CPUs it may run on (as the unit's CPUAffinity=); empty: the test's
};

class Daemon {
public:
    explicit Daemon(const DaemonOptions &o = {}) {
        dir_ = make_temp_dir();
        socket_ = dir_ + "/ringd.sock";
        config_ = dir_ + "/ringd.yaml";
        log_ = dir_ + "/ringd.log";
        host_ = o.host;
        std::ofstream(config_) << "cluster: test\n"
                               << (o.hosts_yaml.empty() ? "hosts:\n  - {name: node0, address: 127.0.0.1, port: 7400}\n"
                                                        : o.hosts_yaml)
                               << "socket: " << socket_ << "\n"
                               << "memory: {slot_bytes: " << o.slot_bytes << ", max_slots: " << o.max_slots << "}\n"
                               << "timeouts: {op: " << o.op_timeout << "}\n"
                               << "log: {level: debug}\n"
                               << o.extra_yaml;
        env_ = o.env;
        bin_ = o.bin;
        netns_ = o.netns;
        cpus_ = o.cpus;
        // Its state directory, as the unit's StateDirectory= gives it (kept across restarts).
        std::filesystem::create_directory(dir_ + "/state");
        env_.push_back("STATE_DIRECTORY=" + dir_ + "/state");
        nofile_ = o.nofile;
        uid_ = o.uid;
        gid_ = o.gid;
        if (uid_ != 0) {  // the daemon writes its socket into the directory
            (void)!::chown(dir_.c_str(), uid_, gid_);
            (void)!::chown(config_.c_str(), uid_, gid_);
            (void)!::chown((dir_ + "/state").c_str(), uid_, gid_);
        }
        start();
    }
    ~Daemon() {
        if (pid_ > 0) {
            ::kill(pid_, SIGKILL);
            wait_child(pid_, std::chrono::seconds(10));
        }
        // RINGD_TEST_LOGS=1: every daemon's log on stderr when it goes away (for debugging).
        if (env_or("RINGD_TEST_LOGS", "")[0] != '\0') std::cerr << "---- ringd " << host_ << " log:\n" << log() << std::flush;
    }

    void start() {
        // A ringd the test signalled itself (::kill(pid(), SIGKILL)) is reaped first: one still
        // dying holds its port and socket, and the new one would find them taken.
        if (pid_ > 0 && wait_child(pid_, std::chrono::seconds(10)) != -1) pid_ = -1;
        notify_ = std::make_unique<NotifySocket>();
        std::string bin = bin_.empty() ? env_or("RINGD_BIN", "build/daemon/ringd") : bin_;
        if (uid_ != 0) {
            notify_->open_to_everyone();
            // The build tree may sit where that user cannot reach it (a home directory, a 0700
            // temp dir): the daemon runs from a copy in its own directory.
            const std::string copy = dir_ + "/ringd";
            std::error_code ec;
            std::filesystem::copy_file(bin, copy, std::filesystem::copy_options::overwrite_existing, ec);
            if (!ec) {
                ::chmod(copy.c_str(), 0755);
                bin = copy;
            }
        }
        pid_ = ::fork();
        if (pid_ == 0) {
            // A test killed by its timeout takes its daemons along (daemons are started from the
            // test's main thread: the signal comes when the forking thread ends).
            ::prctl(PR_SET_PDEATHSIG, SIGKILL);
            const int log = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
            ::dup2(log, 1);  // nothing of the test's stdout may outlive it (meson waits for EOF)
            ::dup2(log, 2);
            if (uid_ != 0) {  // as ringd.service starts it: LimitMEMLOCK=infinity, then its own user
                const rlimit unlimited{RLIM_INFINITY, RLIM_INFINITY};
                ::setrlimit(RLIMIT_MEMLOCK, &unlimited);
                if (::setgroups(0, nullptr) != 0 || ::setgid(gid_) != 0 || ::setuid(uid_) != 0) ::_exit(126);
            }
            ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // again: a change of credentials clears it
            if (!netns_.empty()) {  // its host: a network namespace (ip netns's bind mount)
                const int ns = ::open(("/run/netns/" + netns_).c_str(), O_RDONLY | O_CLOEXEC);
                if (ns < 0 || ::setns(ns, CLONE_NEWNET) != 0) ::_exit(125);
                ::close(ns);
            }
            ::setenv("NOTIFY_SOCKET", notify_->path().c_str(), 1);
            for (const auto &kv : env_) ::putenv(const_cast<char *>(kv.c_str()));
            if (nofile_ > 0) {
                const rlimit lim{static_cast<rlim_t>(nofile_), static_cast<rlim_t>(nofile_)};
                ::setrlimit(RLIMIT_NOFILE, &lim);
            }
            if (!cpus_.empty()) {  // as systemd applies CPUAffinity= before it executes the unit
                cpu_set_t set;
                CPU_ZERO(&set);
                for (int c : cpus_) CPU_SET(c, &set);
                if (::sched_setaffinity(0, sizeof set, &set) != 0) ::_exit(124);
            }
            ::execl(bin.c_str(), bin.c_str(), "--config", config_.c_str(), "--host", host_.c_str(), nullptr);
            ::_exit(127);
        }
        ready_ = notify_->wait_for("READY=1", std::chrono::seconds(10));
    }
    bool ready() const { return ready_; }
    pid_t pid() const { return pid_; }
    // The ringd the next start() runs (a rolling upgrade); empty: $RINGD_BIN.
    void set_bin(std::string bin) { bin_ = std::move(bin); }
    const std::string &socket() const { return socket_; }
    const std::string &dir() const { return dir_; }
    std::string log() const { return read_file(log_); }
    NotifySocket &notify() { return *notify_; }
    bool alive() const { return pid_ > 0 && ::kill(pid_, 0) == 0 && ::waitpid(pid_, nullptr, WNOHANG) == 0; }

    // A signal to it (SIGSTOP, SIGCONT: a host that hangs and comes back).
    void signal(int sig) const { ::kill(pid_, sig); }
    // SIGKILL and wait (what an operator does with a hung daemon); start() runs it again.
    void kill() {
        ::kill(pid_, SIGKILL);
        if (wait_child(pid_, std::chrono::seconds(10)) != -1) pid_ = -1;
    }

    // SIGTERM and wait; returns the wait status (or -1 on timeout).
    int stop(std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
        ::kill(pid_, SIGTERM);
        const int st = wait_child(pid_, timeout);
        if (st != -1) pid_ = -1;
        return st;
    }

private:
    std::string dir_, socket_, config_, log_, host_;
    std::string bin_, netns_;
    std::vector<int> cpus_;
    std::vector<std::string> env_;
    int nofile_ = 0;
    uid_t uid_ = 0;
    gid_t gid_ = 0;
    std::unique_ptr<NotifySocket> notify_;
    pid_t pid_ = -1;
    bool ready_ = false;
};

struct CommandResult {
    int exit_code = -1;  // -1: did not exit normally
    std::string output;  // stdout (add 2>&1 to the command for stderr)
};

// Runs a shell command to completion and captures its output.
inline CommandResult run_command(const std::string &cmd) {
    CommandResult r;
    FILE *p = ::popen(cmd.c_str(), "r");
    if (!p) return r;
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
    const int st = ::pclose(p);
    r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    return r;
}

// Forks `fn` into a child process; its return value is the exit code.
inline pid_t spawn(const std::function<int()> &fn) {
    const pid_t pid = ::fork();
    if (pid == 0) {
        int rc = 99;
        try {
            rc = fn();
        } catch (...) {
            rc = 98;
        }
        ::_exit(rc);
    }
    return pid;
}

// Exit code of a child, or -1 when it did not exit normally within the timeout.
inline int join(pid_t pid, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    const int st = wait_child(pid, timeout);
    if (st == -1) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
        return -1;
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

// Kills a forked trainer that still runs when the test case ends early (a failed REQUIRE):
// nothing a test starts may outlive it, or hold its stdout open. A reaped child is left alone.
struct Reaper {
    pid_t pid;
    ~Reaper() {
        if (pid > 0 && ::waitpid(pid, nullptr, WNOHANG) == 0) {
            ::kill(pid, SIGKILL);
            ::waitpid(pid, nullptr, 0);
        }
    }
};

// A raw connection to the daemon's socket, for hostile-client tests.
inline UniqueFd raw_connect(const std::string &path) {
    UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strcpy(a.sun_path, path.c_str());
    if (::connect(s.get(), reinterpret_cast<sockaddr *>(&a), sizeof a) != 0) return UniqueFd();
    return s;
}

// True when the peer closed `fd` (EOF) within the timeout; data before the EOF is discarded.
inline bool closed_by_peer(int fd, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, ms_until(deadline)) <= 0) return false;
        char buf[4096];
        const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return true;
    }
}

}  // namespace ringd::test
