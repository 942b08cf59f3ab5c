// The CPU time of a bench/cluster run's timed ops. bench/cluster --cpu starts every process of the
// cluster (the daemons, the ranks, the peers' launchers) in one cgroup and names its usage counter
// in RINGD_BENCH_CPU (a /proc/PID/fd path: the namespaces' own /sys hides the cgroup mounts) and
// RINGD_BENCH_CPU_KIND (v1: cpuacct.usage, ns; v2: cpu.stat's usage_usec). Rank 0 reads it around
// each size's timed loop, which every rank runs at the same time (a barrier before, collective
// ops inside), so the difference is what the whole system spent on the timed ops — without the
// data fill and check, start-up and warm-up that the whole run's figure also counts.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ringd::bench {

class ClusterCpu {
public:
    ClusterCpu() {
        const char *path = std::getenv("RINGD_BENCH_CPU");
        const char *kind = std::getenv("RINGD_BENCH_CPU_KIND");
        if (!path || !kind) return;
        v2_ = std::strcmp(kind, "v2") == 0;
        fd_ = ::open(path, O_RDONLY | O_CLOEXEC);
    }
    ~ClusterCpu() {
        if (fd_ >= 0) ::close(fd_);
    }
    ClusterCpu(const ClusterCpu &) = delete;
    ClusterCpu &operator=(const ClusterCpu &) = delete;

    // CPU seconds of the whole cluster so far, or a negative value where it is not counted.
    double seconds() const {
        if (fd_ < 0) return -1;
        char buf[4096];
        const ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);  // cgroup files render afresh from offset 0
        if (n <= 0) return -1;
        buf[n] = '\0';
        if (!v2_) return std::strtod(buf, nullptr) / 1e9;
        const char *at = std::strstr(buf, "usage_usec ");
        return at ? std::strtod(at + 11, nullptr) / 1e6 : -1;
    }

    // The line harnesses read (bench/compare): one per size, after its row.
    static void print(unsigned long long bytes, int ops, double begin, double end) {
        if (begin < 0 || end < begin) return;
        std::printf("# timed cpu: %llu bytes x %d ops, %.4f s\n", bytes, ops, end - begin);
        std::fflush(stdout);
    }

private:
    int fd_ = -1;
    bool v2_ = false;
};

}  // namespace ringd::bench
