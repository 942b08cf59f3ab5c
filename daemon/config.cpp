#include "daemon/config.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cctype>

#include <yaml-cpp/yaml.h>

#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "common/units.h"

namespace ringd {
namespace {

// Thrown only inside this file and turned into an Error by parse_config.
struct ConfigError {
    std::string message;
};

[[noreturn]] void fail(const std::string &key, const std::string &why) { throw ConfigError{key + ": " + why}; }

std::string scalar(const YAML::Node &n, const std::string &key) {
    if (!n.IsScalar()) fail(key, "expected a single value");
    return n.Scalar();
}

void check_keys(const YAML::Node &map, const std::string &where, std::initializer_list<const char *> known) {
    if (!map.IsMap()) fail(where.empty() ? "config" : where, "expected a mapping");
    std::vector<std::string> seen;
    for (const auto &kv : map) {
        const std::string k = kv.first.as<std::string>();
        // YAML allows a key twice and the parser keeps the first: refuse it, it is a mistake.
        if (std::find(seen.begin(), seen.end(), k) != seen.end())
            fail(where.empty() ? k : where + "." + k, "appears twice");
        seen.push_back(k);
        bool found = false;
        for (const char *n : known) found = found || k == n;
        if (!found) {
            std::string list;
            for (const char *n : known) list += (list.empty() ? "" : ", ") + std::string(n);
            fail(where.empty() ? k : where + "." + k, "unknown key (known here: " + list + ")");
        }
    }
}

uint64_t get_uint(const YAML::Node &n, const std::string &key, uint64_t lo, uint64_t hi) {
    const std::string s = scalar(n, key);
    uint64_t v = 0;
    if (s.empty() || s.size() > 19 || s.find_first_not_of("0123456789") != std::string::npos)
        fail(key, "'" + s + "' is not a non-negative integer");
    v = std::stoull(s);
    if (v < lo || v > hi) fail(key, std::to_string(v) + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return v;
}

uint64_t get_size(const YAML::Node &n, const std::string &key) {
    const std::string s = scalar(n, key);
    auto v = parse_size(s);
    if (!v) fail(key, "'" + s + "' is not a size (examples: 4096, 64KiB, 256MiB, 1GiB)");
    return *v;
}

std::chrono::milliseconds get_duration(const YAML::Node &n, const std::string &key) {
    const std::string s = scalar(n, key);
    auto v = parse_duration(s);
    if (!v || v->count() == 0) fail(key, "'" + s + "' is not a positive duration (examples: 500ms, 30s, 2m)");
    return *v;
}

bool get_bool(const YAML::Node &n, const std::string &key) {
    const std::string s = scalar(n, key);
    if (s == "true") return true;
    if (s == "false") return false;
    fail(key, "'" + s + "' is not true or false");
}

std::string get_choice(const YAML::Node &n, const std::string &key, std::initializer_list<const char *> choices) {
    const std::string s = scalar(n, key);
    std::string list;
    for (const char *c : choices) {
        if (s == c) return s;
        list += (list.empty() ? "" : " | ") + std::string(c);
    }
    fail(key, "'" + s + "' is not one of " + list);
}

std::vector<uint32_t> get_id_list(const YAML::Node &n, const std::string &key) {
    if (!n.IsSequence()) fail(key, "expected a list of numeric ids");
    std::vector<uint32_t> ids;
    for (size_t i = 0; i < n.size(); ++i)
        ids.push_back(static_cast<uint32_t>(get_uint(n[i], key + "[" + std::to_string(i) + "]", 0, UINT32_MAX - 1)));
    return ids;
}

void parse_hosts(const YAML::Node &n, Config &c) {
    if (!n.IsSequence() || n.size() == 0) fail("hosts", "expected a non-empty list of {name, address, port}");
    std::set<std::string> names, endpoints;
    for (size_t i = 0; i < n.size(); ++i) {
        const std::string at = "hosts[" + std::to_string(i) + "]";
        check_keys(n[i], at, {"name", "address", "port", "weights"});
        HostEntry h;
        if (!n[i]["name"]) fail(at + ".name", "missing");
        if (!n[i]["address"]) fail(at + ".address", "missing");
        h.name = scalar(n[i]["name"], at + ".name");
        if (n[i]["address"].IsSequence()) {
            // One address per rail (NIC), rail 0 first.
            const auto &list = n[i]["address"];
            if (list.size() == 0 || list.size() > kMaxRails)
                fail(at + ".address", "a list of 1 to " + std::to_string(kMaxRails) + " addresses (one per rail)");
            h.address = scalar(list[0], at + ".address[0]");
            for (size_t r = 1; r < list.size(); ++r) {
                h.rails.push_back(scalar(list[r], at + ".address[" + std::to_string(r) + "]"));
                if (h.rails.back().empty()) fail(at + ".address[" + std::to_string(r) + "]", "is empty");
            }
        } else {
            h.address = scalar(n[i]["address"], at + ".address");
        }
        if (auto w = n[i]["weights"]) {
            if (!w.IsSequence() || w.size() != h.rail_count())
                fail(at + ".weights", "one weight per address (" + std::to_string(h.rail_count()) + ")");
            for (size_t r = 0; r < w.size(); ++r) {
                const std::string key = at + ".weights[" + std::to_string(r) + "]";
                const std::string v = scalar(w[r], key);
                char *end = nullptr;
                const double x = std::strtod(v.c_str(), &end);
                if (v.empty() || *end || !(x > 0) || x > 1e6) fail(key, "'" + v + "' is not a positive number");
                h.weights.push_back(x);
            }
        }
        if (h.name.empty()) fail(at + ".name", "is empty");
        // Trainers list a group's hosts by these names (ringd_connect_opts), comma-separated.
        for (char ch : h.name)
            if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '.' && ch != '_' && ch != '-')
                fail(at + ".name", "'" + h.name + "' may contain only letters, digits, '.', '_' and '-'");
        if (h.address.empty()) fail(at + ".address", "is empty");
        if (n[i]["port"]) h.port = static_cast<uint16_t>(get_uint(n[i]["port"], at + ".port", 1, 65535));
        if (!names.insert(h.name).second) fail(at + ".name", "'" + h.name + "' appears twice");
        for (uint32_t r = 0; r < h.rail_count(); ++r)
            if (!endpoints.insert(h.rail_address(r) + ":" + std::to_string(h.port)).second)
                fail(at, "address " + h.rail_address(r) + ":" + std::to_string(h.port) + " appears twice");
        if (!c.hosts.empty() && h.rail_count() != c.hosts.front().rail_count())
            fail(at + ".address", "every host lists as many addresses (rails): " + c.hosts.front().name + " has " +
                                      std::to_string(c.hosts.front().rail_count()) + ", " + h.name + " " +
                                      std::to_string(h.rail_count()));
        c.hosts.push_back(std::move(h));
    }
}

Config parse_root(const YAML::Node &root) {
    Config c;
    check_keys(root, "", {"cluster", "hosts", "transport", "tcp", "ibverbs", "socket", "socket_group", "allow_uids",
                          "allow_gids", "memory", "limits", "timeouts", "poll", "tuning", "auth", "cuda", "log", "metrics", "wire", "topology"});
    if (!root["cluster"]) fail("cluster", "missing (a name shared by every host of the ring)");
    c.cluster = scalar(root["cluster"], "cluster");
    if (c.cluster.empty()) fail("cluster", "is empty");
    if (!root["hosts"]) fail("hosts", "missing (the ring's hosts, in ring order)");
    parse_hosts(root["hosts"], c);
    if (auto n = root["transport"]) c.transport = get_choice(n, "transport", {"tcp", "ibverbs"});
    if (auto n = root["tcp"]) {
        check_keys(n, "tcp", {"streams", "congestion", "socket_buffer", "zero_copy", "rail_timeout"});
        if (n["zero_copy"]) c.tcp.zero_copy = get_bool(n["zero_copy"], "tcp.zero_copy");
        if (n["rail_timeout"]) {
            c.tcp.rail_timeout = get_duration(n["rail_timeout"], "tcp.rail_timeout");
            if (c.tcp.rail_timeout < std::chrono::milliseconds(200) || c.tcp.rail_timeout > std::chrono::minutes(10))
                fail("tcp.rail_timeout", "must be between 200ms (the kernel's least retransmission timeout) and 10m");
        }
        if (n["streams"]) c.tcp.streams = static_cast<uint32_t>(get_uint(n["streams"], "tcp.streams", 1, 64));
        if (n["socket_buffer"]) {
            const std::string v = scalar(n["socket_buffer"], "tcp.socket_buffer");
            const auto size = parse_size(v);
            if (v != "auto" && (!size || *size < (64u << 10) || *size > (1u << 30)))
                fail("tcp.socket_buffer", "must be auto or a size between 64KiB and 1GiB, not '" + v + "'");
            c.tcp.socket_buffer = v == "auto" ? 0 : *size;
        }
        if (n["congestion"]) {
            c.tcp.congestion = scalar(n["congestion"], "tcp.congestion");
            c.tcp.congestion_set = true;
            const bool name_ok = !c.tcp.congestion.empty() && c.tcp.congestion.size() < 16 &&
                                 std::all_of(c.tcp.congestion.begin(), c.tcp.congestion.end(), [](char ch) {
                                     return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_';
                                 });
            if (!name_ok)
                fail("tcp.congestion", "'" + c.tcp.congestion +
                                           "' is not a congestion control name (examples: cubic, reno, bbr, dctcp; or system)");
        }
    }
    if (auto n = root["ibverbs"]) {
        check_keys(n, "ibverbs",
                   {"provider", "device", "port", "gid_index", "mtu", "qps_per_link", "timeout", "retry_cnt", "rnr_retry"});
        if (n["provider"]) c.ibverbs.provider = get_choice(n["provider"], "ibverbs.provider", {"hardware", "emulated"});
        if (n["device"]) c.ibverbs.device = scalar(n["device"], "ibverbs.device");
        if (n["mtu"]) {
            c.ibverbs.mtu = static_cast<uint32_t>(get_uint(n["mtu"], "ibverbs.mtu", 0, 4096));
            if (c.ibverbs.mtu != 0 && (c.ibverbs.mtu < 256 || (c.ibverbs.mtu & (c.ibverbs.mtu - 1))))
                fail("ibverbs.mtu", "must be 0 (the port's), 256, 512, 1024, 2048 or 4096");
        }
        if (n["qps_per_link"])
            c.ibverbs.qps_per_link = static_cast<uint32_t>(get_uint(n["qps_per_link"], "ibverbs.qps_per_link", 1, 8));
        if (n["timeout"]) c.ibverbs.timeout = static_cast<uint32_t>(get_uint(n["timeout"], "ibverbs.timeout", 0, 31));
        if (n["retry_cnt"]) c.ibverbs.retry_cnt = static_cast<uint32_t>(get_uint(n["retry_cnt"], "ibverbs.retry_cnt", 0, 7));
        if (n["rnr_retry"]) c.ibverbs.rnr_retry = static_cast<uint32_t>(get_uint(n["rnr_retry"], "ibverbs.rnr_retry", 0, 7));
        if (n["port"]) c.ibverbs.port = static_cast<uint32_t>(get_uint(n["port"], "ibverbs.port", 1, 255));
        if (n["gid_index"]) {
            c.ibverbs.gid_index = scalar(n["gid_index"], "ibverbs.gid_index");
            if (c.ibverbs.gid_index != "auto") get_uint(n["gid_index"], "ibverbs.gid_index", 0, 255);
        }
    }
    if (auto n = root["socket"]) {
        c.socket = scalar(n, "socket");
        if (c.socket.empty() || c.socket.size() >= 108) fail("socket", "must be a path of 1..107 bytes");
    }
    if (auto n = root["socket_group"]) c.socket_group = scalar(n, "socket_group");
    if (auto n = root["allow_uids"]) c.allow_uids = get_id_list(n, "allow_uids");
    if (auto n = root["allow_gids"]) c.allow_gids = get_id_list(n, "allow_gids");
    if (auto n = root["memory"]) {
        check_keys(n, "memory", {"slot_bytes", "max_slots"});
        if (n["slot_bytes"]) {
            c.memory.slot_bytes = get_size(n["slot_bytes"], "memory.slot_bytes");
            if (c.memory.slot_bytes < 4096 || c.memory.slot_bytes > (1ull << 40))
                fail("memory.slot_bytes", "must be between 4KiB and 1TiB");
        }
        if (n["max_slots"])
            c.memory.max_slots = static_cast<uint32_t>(get_uint(n["max_slots"], "memory.max_slots", 1, 4096));
    }
    if (auto n = root["cuda"]) {
        check_keys(n, "cuda", {"provider", "max_mapped_bytes"});
        if (n["provider"]) c.cuda.provider = get_choice(n["provider"], "cuda.provider", {"hardware", "emulated"});
        if (n["max_mapped_bytes"]) {
            c.cuda.max_mapped_bytes = get_size(n["max_mapped_bytes"], "cuda.max_mapped_bytes");
            if (c.cuda.max_mapped_bytes < (2ull << 20)) fail("cuda.max_mapped_bytes", "must be at least 2MiB");
        }
    }
    if (auto n = root["limits"]) {
        check_keys(n, "limits", {"slots_per_uid", "connections_per_uid", "ring_domains"});
        if (n["ring_domains"])
            c.limits.ring_domains = static_cast<uint32_t>(get_uint(n["ring_domains"], "limits.ring_domains", 1, 256));
        if (n["slots_per_uid"])
            c.limits.slots_per_uid = static_cast<uint32_t>(get_uint(n["slots_per_uid"], "limits.slots_per_uid", 1, 4096));
        if (n["connections_per_uid"])
            c.limits.connections_per_uid =
                static_cast<uint32_t>(get_uint(n["connections_per_uid"], "limits.connections_per_uid", 1, 65536));
    }
    if (c.limits.slots_per_uid == 0) c.limits.slots_per_uid = c.memory.max_slots;
    if (c.limits.connections_per_uid == 0) c.limits.connections_per_uid = c.memory.max_slots + 16;
    if (auto n = root["timeouts"]) {
        check_keys(n, "timeouts", {"op", "op_max", "connect", "heartbeat"});
        if (n["op"]) c.timeouts.op = get_duration(n["op"], "timeouts.op");
        if (n["op_max"]) c.timeouts.op_max = get_duration(n["op_max"], "timeouts.op_max");
        else c.timeouts.op_max = std::max(c.timeouts.op_max, c.timeouts.op);
        if (c.timeouts.op_max > std::chrono::hours(24)) fail("timeouts.op_max", "must be at most 24h");
        if (c.timeouts.op_max < c.timeouts.op) fail("timeouts.op_max", "must be at least timeouts.op");
        if (n["connect"]) c.timeouts.connect = get_duration(n["connect"], "timeouts.connect");
        if (n["heartbeat"]) c.timeouts.heartbeat = get_duration(n["heartbeat"], "timeouts.heartbeat");
        if (c.timeouts.op > std::chrono::hours(24)) fail("timeouts.op", "must be at most 24h");
    }
    if (auto n = root["poll"]) {
        const std::string p = get_choice(n, "poll", {"event", "busy", "adaptive"});
        c.poll = p == "event" ? PollMode::Event : p == "busy" ? PollMode::Busy : PollMode::Adaptive;
    }
    if (auto n = root["tuning"]) {
        check_keys(n, "tuning", {"direct_max_bytes", "hop_latency_us", "link_mbit", "chunk_bytes", "depth", "lanes", "control_spin_us",
                        "message_us", "algorithm"});
        if (n["lanes"]) c.tuning.lanes = static_cast<uint32_t>(get_uint(n["lanes"], "tuning.lanes", 1, 8));
        if (n["direct_max_bytes"]) {
            c.tuning.direct_max_bytes = get_size(n["direct_max_bytes"], "tuning.direct_max_bytes");
            if (c.tuning.direct_max_bytes > (16u << 20)) fail("tuning.direct_max_bytes", "must be at most 16MiB");
        }
        if (n["hop_latency_us"])
            c.tuning.hop_latency_us = static_cast<uint32_t>(get_uint(n["hop_latency_us"], "tuning.hop_latency_us", 1, 1'000'000));
        if (n["message_us"])
            c.tuning.message_us = static_cast<uint32_t>(get_uint(n["message_us"], "tuning.message_us", 0, 1'000'000));
        if (n["algorithm"]) {
            static const char *const names[] = {"ring", "one-shot", "two-shot", "doubling", "halving-doubling"};
            const std::string a = get_choice(n["algorithm"], "tuning.algorithm",
                                             {"auto", names[0], names[1], names[2], names[3], names[4]});
            for (uint32_t i = 0; i < 5; ++i)
                if (a == names[i]) c.tuning.algorithm = i;
        }
        if (n["control_spin_us"])
            c.tuning.control_spin_us = static_cast<uint32_t>(get_uint(n["control_spin_us"], "tuning.control_spin_us", 0, 10'000));
        if (n["link_mbit"]) c.tuning.link_mbit = get_uint(n["link_mbit"], "tuning.link_mbit", 1, 100'000'000);
        if (n["chunk_bytes"]) {
            c.tuning.chunk_bytes = get_size(n["chunk_bytes"], "tuning.chunk_bytes");
            if (c.tuning.chunk_bytes < 4096 || c.tuning.chunk_bytes > (64u << 20))
                fail("tuning.chunk_bytes", "must be between 4KiB and 64MiB");
        }
        if (n["depth"]) c.tuning.depth = static_cast<uint32_t>(get_uint(n["depth"], "tuning.depth", 1, 256));
        if (c.tuning.chunk_bytes * c.tuning.depth > (1ull << 30))
            fail("tuning.depth", "chunk_bytes x depth (the ring's staging memory) must be at most 1GiB");
    }
    if (auto n = root["topology"]) {
        check_keys(n, "topology", {"sysfs_root", "pin"});
        if (n["sysfs_root"]) {
            c.topology.sysfs_root = scalar(n["sysfs_root"], "topology.sysfs_root");
            if (c.topology.sysfs_root.empty() || c.topology.sysfs_root.front() != '/')
                fail("topology.sysfs_root", "must be an absolute path (\"/\": this machine's sysfs), got \"" +
                                                c.topology.sysfs_root + "\"");
        }
        if (n["pin"]) {
            const std::string pin = get_choice(n["pin"], "topology.pin", {"on", "off", "true", "false"});
            c.topology.pin = pin == "on" || pin == "true";
        }
    }
    if (auto n = root["wire"]) {
        check_keys(n, "wire", {"default", "feedback_max_bytes", "schedule"});
        if (n["schedule"]) c.wire.exchange = get_choice(n["schedule"], "wire.schedule", {"exchange", "ring"}) == "exchange";
        if (n["default"]) c.wire.format = *parse_wire_format(get_choice(n["default"], "wire.default", {"exact", "bf16", "fp16", "int8"}));
        if (n["feedback_max_bytes"]) c.wire.feedback_max_bytes = get_size(n["feedback_max_bytes"], "wire.feedback_max_bytes");
    }
    if (auto n = root["auth"]) {
        check_keys(n, "auth", {"secret_file", "insecure", "data", "rotation_grace"});
        if (n["rotation_grace"]) c.rotation_grace = get_duration(n["rotation_grace"], "auth.rotation_grace");
        if (n["secret_file"]) c.secret_file = scalar(n["secret_file"], "auth.secret_file");
        if (n["insecure"]) c.insecure = get_bool(n["insecure"], "auth.insecure");
        if (n["data"]) {
            c.data_mac = get_choice(n["data"], "auth.data", {"mac", "none"}) == "mac";
            if (c.data_mac && c.transport != "tcp")
                fail("auth.data", "mac is for TCP data streams; with transport: " + c.transport +
                                      " the NIC writes data straight into registered memory (its QPs and keys travel on "
                                      "authenticated connections): set auth.data: none");
        }
    }
    if (c.transport != "tcp") c.data_mac = false;
    if (!c.hosts.empty() && c.tcp.streams * c.hosts.front().rail_count() > 256)
        fail("tcp.streams", std::to_string(c.tcp.streams) + " streams on each of " + std::to_string(c.hosts.front().rail_count()) +
                                " rails: at most 256 connections per link");
    if (c.transport != "tcp" && !c.hosts.empty() && c.hosts.front().rail_count() > 1)
        fail("hosts", "several addresses per host (rails) are for transport: tcp; with " + c.transport +
                          " each host lists one address");
    // Secure by default: daemons of a ring accept each other only with a shared secret.
    if (c.hosts.size() > 1 && c.secret_file.empty() && !c.insecure)
        fail("auth.secret_file", "missing: the daemons of a ring of several hosts authenticate each other with a "
                                 "shared secret (e.g. openssl rand -hex 32 > /etc/ringd/secret, mode 0640, group ringd); "
                                 "auth.insecure: true runs without one");
    if (auto n = root["metrics"]) {
        check_keys(n, "metrics", {"listen"});
        if (n["listen"]) {
            const std::string l = scalar(n["listen"], "metrics.listen");
            if (!l.empty()) {
                const auto colon = l.rfind(':');
                std::string addr = colon == std::string::npos ? std::string() : l.substr(0, colon);
                const std::string port = colon == std::string::npos ? std::string() : l.substr(colon + 1);
                const bool v6 = addr.size() > 2 && addr.front() == '[' && addr.back() == ']';
                if (v6) addr = addr.substr(1, addr.size() - 2);
                unsigned char buf[16];
                const bool addr_ok = ::inet_pton(v6 ? AF_INET6 : AF_INET, addr.c_str(), buf) == 1;
                const bool port_ok = !port.empty() && port.size() <= 5 &&
                                     port.find_first_not_of("0123456789") == std::string::npos && std::stoul(port) <= 65535;
                if (!addr_ok || !port_ok)
                    fail("metrics.listen", "must be ADDRESS:PORT with an IPv4 address or a bracketed IPv6 one "
                                           "(e.g. 127.0.0.1:9465 or [::1]:9465), got \"" + l + "\"");
                c.metrics.address = addr;
                c.metrics.port = static_cast<uint16_t>(std::stoul(port));
            }
            c.metrics.listen = l;
        }
    }
    if (auto n = root["log"]) {
        check_keys(n, "log", {"level", "journal"});
        if (n["level"]) c.log_level = get_choice(n["level"], "log.level", {"trace", "debug", "info", "warn", "error"});
        if (n["journal"]) c.log_journal = get_choice(n["journal"], "log.journal", {"auto", "on", "off"});
    }
    return c;
}

}  // namespace

Result<Config> parse_config(const std::string &text) {
    try {
        YAML::Node root = YAML::Load(text);
        if (!root || root.IsNull()) return make_error(-EINVAL, "config is empty");
        return parse_root(root);
    } catch (const ConfigError &e) {
        return make_error(-EINVAL, e.message);
    } catch (const YAML::Exception &e) {
        return make_error(-EINVAL, std::string("YAML syntax: ") + e.what());
    }
}

Result<Config> load_config(const std::string &path) {
    std::ifstream in(path);
    if (!in) return make_error(-ENOENT, "cannot read config " + path + ": " + std::strerror(errno));
    std::stringstream ss;
    ss << in.rdbuf();
    auto c = parse_config(ss.str());
    if (!c) return make_error(c.error().code, path + ": " + c.error().message);
    return c;
}

Result<size_t> find_host(const Config &c, const std::string &host) {
    std::string names;
    for (size_t i = 0; i < c.hosts.size(); ++i) {
        if (c.hosts[i].name == host) return i;
        names += (names.empty() ? "" : ", ") + c.hosts[i].name;
    }
    return make_error(-ENOENT, "host '" + host + "' is not in hosts (configured: " + names + ")");
}

const char *poll_mode_name(PollMode m) {
    switch (m) {
    case PollMode::Event: return "event";
    case PollMode::Busy: return "busy";
    case PollMode::Adaptive: return "adaptive";
    }
    return "?";
}

Result<std::vector<uint32_t>> group_hosts(const Config &c, const std::string &list) {
    std::vector<uint32_t> all(c.hosts.size());
    for (uint32_t i = 0; i < all.size(); ++i) all[i] = i;
    if (list.find_first_not_of(' ') == std::string::npos) return all;
    std::vector<bool> in(c.hosts.size(), false);
    size_t at = 0;
    for (;;) {
        const size_t comma = list.find(',', at);
        std::string name = list.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
        name.erase(0, name.find_first_not_of(' '));
        name.erase(name.find_last_not_of(' ') + 1);
        if (name.empty()) return make_error(-EINVAL, "the hosts list '" + list + "' has an empty name");
        auto i = find_host(c, name);
        if (!i) return make_error(-EINVAL, "the hosts list names '" + name + "', which is not a host of this ring (" +
                                               host_names(c, all) + ")");
        if (in[*i]) return make_error(-EINVAL, "the hosts list names '" + name + "' twice");
        in[*i] = true;
        if (comma == std::string::npos) break;
        at = comma + 1;
    }
    std::vector<uint32_t> out;
    for (uint32_t i = 0; i < in.size(); ++i)
        if (in[i]) out.push_back(i);
    return out;
}

std::string host_names(const Config &c, const std::vector<uint32_t> &hosts) {
    std::string s;
    for (uint32_t i : hosts) s += (s.empty() ? "" : ",") + c.hosts[i].name;
    return s;
}

}  // namespace ringd
