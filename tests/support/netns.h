// Test hosts as network namespaces (root): ringd-t<pid>-<k>-<i>, each with a veth (eth0) on a
// bridge that lives in a namespace of its own (…-sw), addresses 10.251.<k>.(i+1)/24 that exist
// only inside them and no route out, as bench/cluster makes them. With rails, a veth per rail r
// (eth<r> on bridge br<r>; rail r > 0 at 10.(240 + r).<k>.(i+1)). A ringd runs in its host's
// namespace (DaemonOptions::netns); trainers reach it through its Unix socket, which namespaces
// do not separate. Torn down with the object (and anything still running in them).
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "tests/support/harness.h"

namespace ringd::test {

class NetnsHosts {
public:
    explicit NetnsHosts(uint32_t n, uint32_t rails = 1) : rails_(rails) {
        static int made = 0;
        k_ = made++;
        tag_ = "ringd-t" + std::to_string(::getpid()) + "-" + std::to_string(k_);
        sh("ip netns add " + tag_ + "-sw");
        names_.push_back(tag_ + "-sw");
        for (uint32_t r = 0; r < rails_; ++r)
            sh("ip -n " + tag_ + "-sw link add br" + std::to_string(r) + " type bridge && ip -n " + tag_ + "-sw link set br" +
               std::to_string(r) + " up");
        for (uint32_t i = 0; i < n; ++i) add();
    }
    ~NetnsHosts() {
        for (const auto &ns : names_)
            (void)run_command("ip netns pids " + ns + " 2>/dev/null | xargs -r kill -9 2>/dev/null; ip netns del " + ns +
                              " 2>/dev/null");
    }
    NetnsHosts(const NetnsHosts &) = delete;
    NetnsHosts &operator=(const NetnsHosts &) = delete;

    // One more host on the bridge; its index.
    uint32_t add() {
        const uint32_t i = static_cast<uint32_t>(hosts_.size());
        const std::string ns = tag_ + "-" + std::to_string(i);
        const std::string h = "rt" + std::to_string(::getpid() % 100000) + "x" + std::to_string(k_) + "h" + std::to_string(i);
        const std::string s = "rt" + std::to_string(::getpid() % 100000) + "x" + std::to_string(k_) + "s" + std::to_string(i);
        sh("ip netns add " + ns);
        names_.push_back(ns);
        for (uint32_t r = 0; r < rails_; ++r) {
            const std::string hr = h + (r ? "r" + std::to_string(r) : ""), sr = s + (r ? "r" + std::to_string(r) : "");
            const std::string eth = "eth" + std::to_string(r);
            sh("ip link add " + hr + " type veth peer name " + sr + " && ip link set " + hr + " netns " + ns + " name " + eth +
               " && ip link set " + sr + " netns " + tag_ + "-sw && ip -n " + tag_ + "-sw link set " + sr + " master br" +
               std::to_string(r) + " up && ip -n " + ns + " addr add " + address(i, r) + "/24 dev " + eth + " && ip -n " + ns +
               " link set " + eth + " up");
        }
        sh("ip -n " + ns + " link set lo up");
        hosts_.push_back(ns);
        return i;
    }
    size_t size() const { return hosts_.size(); }
    const std::string &ns(uint32_t i) const { return hosts_.at(i); }
    std::string address(uint32_t i, uint32_t rail = 0) const {
        return "10." + std::to_string(rail ? 240 + rail : 251) + "." + std::to_string(k_ % 250) + "." + std::to_string(i + 1);
    }
    uint32_t rails() const { return rails_; }
    // Host i's `address:` in a config: one address, or one per rail.
    std::string addresses_yaml(uint32_t i) const {
        if (rails_ == 1) return address(i);
        std::string a;
        for (uint32_t r = 0; r < rails_; ++r) a += (r ? ", " : "") + address(i, r);
        return "[" + a + "]";
    }
    // Limits what host i sends on rail r's NIC to `rate` (tc tbf, e.g. "200mbit").
    void limit(uint32_t i, uint32_t rail, const std::string &rate) const {
        sh("ip netns exec " + ns(i) + " tc qdisc replace dev eth" + std::to_string(rail) + " root tbf rate " + rate +
           " burst 256kb latency 100ms");
    }
    // Takes host i's NIC of rail r down or up (ip link set), as when a cable or a switch port goes.
    void set_link(uint32_t i, uint32_t rail, bool up) const {
        sh("ip -n " + ns(i) + " link set eth" + std::to_string(rail) + (up ? " up" : " down"));
    }
    // Bytes host i has sent on rail r's NIC.
    uint64_t tx_bytes(uint32_t i, uint32_t rail) const {
        const auto r = run_command("ip netns exec " + ns(i) + " cat /sys/class/net/eth" + std::to_string(rail) + "/statistics/tx_bytes");
        return r.exit_code == 0 ? std::stoull(r.output) : 0;
    }

    // Whether this machine lets a test make them (root, iproute2, network namespaces).
    static bool available() {
        return ::geteuid() == 0 && run_command("ip netns list >/dev/null 2>&1").exit_code == 0;
    }

private:
    static void sh(const std::string &cmd) {
        const auto r = run_command("(" + cmd + ") 2>&1");
        INFO(cmd << ": " << r.output);
        REQUIRE(r.exit_code == 0);
    }
    int k_ = 0;
    uint32_t rails_ = 1;
    std::string tag_;
    std::vector<std::string> names_;  // every namespace made, the switch's first
    std::vector<std::string> hosts_;
};

}  // namespace ringd::test
