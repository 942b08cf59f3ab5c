// ringd's configuration (config/ringd.yaml documents every key). Parsing validates every value
// and rejects unknown keys; each error names the key path ("memory.slot_bytes: ...").
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "proto/types.h"

#include "proto/result.h"

namespace ringd {

enum class PollMode { Event, Busy, Adaptive };

constexpr uint32_t kMaxRails = 16;  // addresses (NICs) per host

struct HostEntry {
    std::string name;
    std::string address;  // rail 0's: the control connections, and the ring's data on rail 0
    uint16_t port = 7400;
    // Several NICs (`address: [a0, a1, ...]`): the addresses of rails 1, 2, ... (every host lists
    // as many), and each rail's weight (`weights:`, rail 0 first; empty: all equal) by which the
    // ring's messages are spread over them.
    std::vector<std::string> rails;
    std::vector<double> weights;
    uint32_t rail_count() const { return 1 + static_cast<uint32_t>(rails.size()); }
    const std::string &rail_address(uint32_t r) const { return r == 0 ? address : rails.at(r - 1); }
    double rail_weight(uint32_t r) const { return weights.empty() ? 1.0 : weights.at(r); }
};

struct Config {
    std::string cluster;
    std::vector<HostEntry> hosts;  // ring order
    std::string transport = "tcp";
    struct Tcp {
        uint32_t streams = 2;
        // The TCP congestion control (TCP_CONGESTION) of the data streams and the control
        // connections (an all_to_all's data travels on them); "auto": cubic where ringd
        // may set it, else reno (the kernel lets anyone set it), never a pacing one by default;
        // "system": the kernel's default (net.ipv4.tcp_congestion_control). congestion_set:
        // given in the file.
        std::string congestion = "auto";
        bool congestion_set = false;
        // Each stream's SO_SNDBUF and SO_RCVBUF; 0 ("auto"): the kernel sizes them as the
        // connection goes (net.ipv4.tcp_wmem / tcp_rmem), which setting them turns off.
        uint64_t socket_buffer = 0;
        // Large ring messages from the trainers' slots go by reference (sendfile from the slot's
        // memfd), not copied into the socket buffers (daemon/transport/tcp/tcp_transport.h).
        bool zero_copy = true;
        // Several rails: how long a stream's sent data may go unacknowledged by the peer's kernel
        // while retransmitted (TCP_USER_TIMEOUT) before its rail counts as down and its messages
        // go on the other rails (a link of one rail keeps the kernel's default).
        std::chrono::milliseconds rail_timeout{2000};
    } tcp;
    struct Ibverbs {
        std::string provider = "hardware";  // hardware (libibverbs) | emulated (software test device)
        std::string device = "auto";
        uint32_t port = 1;
        std::string gid_index = "auto";  // "auto" or a number
        uint32_t mtu = 0;                // bytes; 0: the port's active MTU
        uint32_t qps_per_link = 1;
        uint32_t timeout = 14, retry_cnt = 7, rnr_retry = 7;
    } ibverbs;
    std::string socket = "/run/ringd/ringd.sock";
    std::string socket_group;  // empty: keep the daemon's group
    std::vector<uint32_t> allow_uids;  // empty: any uid (subject to the socket's mode)
    std::vector<uint32_t> allow_gids;
    struct Memory {
        uint64_t slot_bytes = 256ull << 20;  // largest slot a client may ask for
        uint32_t max_slots = 16;             // concurrent clients with a slot
    } memory;
    struct Cuda {
        std::string provider = "hardware";  // hardware (the NVIDIA driver) | emulated (software device)
        uint64_t max_mapped_bytes = 64ull << 30;  // trainers' device memory mapped at once (LRU beyond)
    } cuda;
    struct Limits {
        uint32_t slots_per_uid = 0;        // slots one uid may hold (default: memory.max_slots)
        // Ring domains (host sets of groups) this host keeps at once, the whole ring's included;
        // over it, an idle one (no group here) is let go for a new one.
        uint32_t ring_domains = 16;
        uint32_t connections_per_uid = 0;  // client connections of one uid (default: max_slots + 16)
    } limits;
    struct Timeouts {
        std::chrono::milliseconds op{30'000};       // an op's deadline, for groups that ask for none
        std::chrono::milliseconds op_max{3'600'000};  // the longest a group may ask for (ringd_options)
        std::chrono::milliseconds connect{60'000};
        std::chrono::milliseconds heartbeat{1'000};
    } timeouts;
    // metrics.listen: "ADDRESS:PORT" (IPv4, or [IPv6]) where /metrics serves Prometheus text;
    // empty: off. Port 0: any free one (status "metrics" says which).
    struct Metrics {
        std::string listen;
        std::string address;  // of listen, without brackets
        uint16_t port = 0;
    } metrics;
    PollMode poll = PollMode::Adaptive;
    // The algorithm per op size (daemon/engine/tuner.h): ops up to direct_max_bytes may go by
    // direct exchange instead of the ring, when the cost model, fed the hop latency and the
    // link rate, says it is faster.
    struct Tuning {
        uint64_t direct_max_bytes = 256 << 10;  // 0: always the ring
        uint32_t hop_latency_us = 100;        // one message's latency, wake-ups included
        // A host's cost per message it sends or takes (frame, MAC, syscalls, its share of the
        // wake-ups): what makes one-shot's n - 1 messages per host dearer than doubling's log2 n.
        uint32_t message_us = 40;
        uint64_t link_mbit = 10'000;          // what one host can send per second
        uint64_t chunk_bytes = 2 << 20;       // the ring's pipeline: its largest chunk
        uint32_t depth = 4;                   // and staging slots of it (smaller chunks: more)
        // Ring lanes per ring domain: each its own data links, staging and progress thread, so
        // that the ring ops of groups over the same hosts run side by side (a group runs in one).
        uint32_t lanes = 2;
        // How long the control thread looks for more work after its last (yielding between
        // looks) before it blocks in epoll; 0: at once (docs/design.md, Threads).
        uint32_t control_spin_us = 200;
        // tuning.algorithm: kAuto (the cost model), else an Algorithm (daemon/engine/tuner.h)
        // every op up to direct_max_bytes takes.
        static constexpr uint32_t kAuto = UINT32_MAX;
        uint32_t algorithm = kAuto;
    } tuning;
    // Compressed wires (docs/wire.md): the format of the ops of groups that name none (each op
    // where it applies: wire_applies), and each group run's bound on error-feedback residuals.
    // Where ringd's threads and memory go (daemon/topology/topology.h): the sysfs tree the
    // machine is read from ("/": this one; a test describes another in a directory), and
    // whether progress threads are pinned and memory placed on their NIC's node.
    struct Topology {
        std::string sysfs_root = "/";
        bool pin = true;
    } topology;
    struct Wire {
        WireFormat format = WireFormat::Exact;  // wire.default
        uint64_t feedback_max_bytes = 1ull << 30;
        // wire.schedule: a compressed f32 allreduce or reduce_scatter on 3 hosts or more runs as
        // the exchange of shards (ExchangeEngine: each value encoded twice, resp. once) where the
        // lanes have data links to every host (peer protocol 13, TCP) and no host says ring;
        // false (`ring`): this host keeps the ring's generations on the ring (one encoding per host).
        bool exchange = true;
    } wire;
    std::string secret_file;  // auth.secret_file; empty: no authentication
    // How long a reload that found a new secret still accepts the previous one.
    std::chrono::milliseconds rotation_grace = std::chrono::hours(1);
    bool insecure = false;    // auth.insecure: several hosts may run without a secret
    // auth.data: mac tags every TCP data message too, as control frames always are with a
    // secret; none (the default) leaves the data streams unauthenticated, as NCCL, Gloo and MPI
    // leave theirs: a CPU-bound ring runs 1.6-1.8x slower with mac (README, Performance).
    // ibverbs: the NIC writes data straight into registered memory, so only none.
    bool data_mac = false;
    std::string log_level = "info";
    std::string log_journal = "auto";  // auto (when systemd connects stderr to the journal) | on | off
};

Result<Config> parse_config(const std::string &yaml_text);
Result<Config> load_config(const std::string &path);

// Index of `host` in config.hosts, or an error listing the configured names.
Result<size_t> find_host(const Config &c, const std::string &host);

// A group's hosts from a trainer's comma-separated list of host names (any order, spaces
// around names ignored; "" = every host): their indices in ring order. Unknown, empty or repeated
// names are errors that say which.
Result<std::vector<uint32_t>> group_hosts(const Config &c, const std::string &list);
// "a,b,c" for indices into config.hosts.
std::string host_names(const Config &c, const std::vector<uint32_t> &hosts);

const char *poll_mode_name(PollMode m);

}  // namespace ringd
