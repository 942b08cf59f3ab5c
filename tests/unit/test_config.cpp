// Config parsing: every error names its key.
#include <catch2/catch.hpp>

#include <cstdlib>

#include "common/units.h"
#include "daemon/config.h"

using namespace ringd;

namespace {

const std::string kBase = "cluster: c\nhosts:\n  - {name: a, address: 127.0.0.1, port: 7400}\n";

std::string error_of(const std::string &yaml) {
    auto c = parse_config(yaml);
    return c.ok() ? "" : c.error().message;
}

}  // namespace

TEST_CASE("a minimal config gets the documented defaults", "[config]") {
    auto c = parse_config(kBase);
    REQUIRE(c.ok());
    CHECK(c->cluster == "c");
    CHECK(c->transport == "tcp");
    CHECK(c->tcp.streams == 2);
    CHECK(c->tcp.congestion == "auto");
    CHECK_FALSE(c->tcp.congestion_set);
    CHECK(c->socket == "/run/ringd/ringd.sock");
    CHECK(c->memory.slot_bytes == 256ull << 20);
    CHECK(c->memory.max_slots == 16);
    CHECK(c->timeouts.op == std::chrono::seconds(30));
    CHECK(c->poll == PollMode::Adaptive);
    CHECK(c->tuning.control_spin_us == 200);
    CHECK(c->log_level == "info");
}

TEST_CASE("the shipped example config parses", "[config]") {
    const char *src = std::getenv("RINGD_SOURCE_DIR");  // the checkout (meson test sets it: tests/meson.build)
    REQUIRE(src != nullptr);
    auto c = load_config(std::string(src) + "/config/ringd.yaml");
    REQUIRE(c.ok());
    CHECK(c->socket_group == "ringd");
}

TEST_CASE("every value is parsed", "[config]") {
    auto c = parse_config(kBase +
                          "transport: ibverbs\ntcp: {streams: 4, congestion: reno}\nibverbs: {device: mlx5_0, port: 2, gid_index: 3, provider: emulated, "
                          "mtu: 2048, qps_per_link: 4, timeout: 18, retry_cnt: 5, rnr_retry: 6}\n"
                          "socket: /tmp/x.sock\nsocket_group: wheel\nallow_uids: [0, 1000]\nallow_gids: [27]\n"
                          "memory: {slot_bytes: 1GiB, max_slots: 4}\ntimeouts: {op: 500ms, connect: 2m, heartbeat: 1s}\n"
                          "poll: busy\nauth: {secret_file: /etc/ringd/secret}\nlog: {level: debug}\n"
                          "tuning: {direct_max_bytes: 256KiB, hop_latency_us: 20, link_mbit: 100000, chunk_bytes: 1MiB, "
                          "depth: 4, control_spin_us: 0}\n");
    REQUIRE(c.ok());
    CHECK(c->transport == "ibverbs");
    CHECK(c->tcp.streams == 4);
    CHECK(c->tcp.congestion == "reno");
    CHECK(c->tcp.congestion_set);
    CHECK(c->ibverbs.device == "mlx5_0");
    CHECK(c->ibverbs.gid_index == "3");
    CHECK(c->ibverbs.provider == "emulated");
    CHECK(c->ibverbs.mtu == 2048);
    CHECK(c->ibverbs.qps_per_link == 4);
    CHECK(c->ibverbs.timeout == 18);
    CHECK(c->ibverbs.retry_cnt == 5);
    CHECK(c->ibverbs.rnr_retry == 6);
    CHECK(c->allow_uids == std::vector<uint32_t>{0, 1000});
    CHECK(c->memory.slot_bytes == 1ull << 30);
    CHECK(c->timeouts.op == std::chrono::milliseconds(500));
    CHECK(c->timeouts.connect == std::chrono::minutes(2));
    CHECK(c->poll == PollMode::Busy);
    CHECK(c->secret_file == "/etc/ringd/secret");
    CHECK(c->tuning.direct_max_bytes == 256u << 10);
    CHECK(c->tuning.hop_latency_us == 20);
    CHECK(c->tuning.link_mbit == 100000);
    CHECK(c->tuning.chunk_bytes == 1u << 20);
    CHECK(c->tuning.depth == 4);
    CHECK(c->tcp.socket_buffer == 0);  // not given: auto
    CHECK(c->tcp.zero_copy);           // not given: on
    CHECK(c->tuning.control_spin_us == 0);
}

TEST_CASE("errors name the key", "[config]") {
    CHECK_THAT(error_of(kBase + "memroy: {}\n"), Catch::StartsWith("memroy: unknown key"));
    CHECK_THAT(error_of(kBase + "memory: {slot_byte: 1}\n"), Catch::StartsWith("memory.slot_byte: unknown key"));
    CHECK_THAT(error_of(kBase + "memory: {slot_bytes: 12XB}\n"), Catch::StartsWith("memory.slot_bytes: '12XB' is not a size"));
    CHECK_THAT(error_of(kBase + "memory: {max_slots: 0}\n"), Catch::StartsWith("memory.max_slots: 0 is out of range"));
    CHECK_THAT(error_of(kBase + "timeouts: {op: 30}\n"), Catch::StartsWith("timeouts.op: '30' is not a positive duration"));
    CHECK_THAT(error_of(kBase + "transport: udp\n"), Catch::StartsWith("transport: 'udp' is not one of tcp | ibverbs"));
    CHECK_THAT(error_of(kBase + "poll: sometimes\n"), Catch::StartsWith("poll:"));
    CHECK_THAT(error_of(kBase + "tcp: {streams: 0}\n"), Catch::StartsWith("tcp.streams:"));
    CHECK_THAT(error_of(kBase + "tcp: {congestion: Cubic}\n"), Catch::StartsWith("tcp.congestion: 'Cubic' is not a congestion control name"));
    CHECK_THAT(error_of(kBase + "tcp: {congestion: ''}\n"), Catch::StartsWith("tcp.congestion:"));
    CHECK_THAT(error_of(kBase + "tcp: {congestion: averyveryverylongname}\n"), Catch::StartsWith("tcp.congestion:"));
    CHECK_THAT(error_of(kBase + "allow_uids: root\n"), Catch::StartsWith("allow_uids:"));
    CHECK_THAT(error_of(kBase + "allow_uids: [x]\n"), Catch::StartsWith("allow_uids[0]:"));
    CHECK_THAT(error_of(kBase + "log: {level: loud}\n"), Catch::StartsWith("log.level:"));
    CHECK_THAT(error_of(kBase + "ibverbs: {gid_index: x}\n"), Catch::StartsWith("ibverbs.gid_index:"));
    CHECK_THAT(error_of(kBase + "ibverbs: {provider: soft}\n"), Catch::StartsWith("ibverbs.provider:"));
    CHECK_THAT(error_of(kBase + "ibverbs: {mtu: 1500}\n"), Catch::StartsWith("ibverbs.mtu:"));
    CHECK_THAT(error_of(kBase + "ibverbs: {qps_per_link: 9}\n"), Catch::StartsWith("ibverbs.qps_per_link:"));
    CHECK_THAT(error_of(kBase + "ibverbs: {retry_cnt: 8}\n"), Catch::StartsWith("ibverbs.retry_cnt:"));
    CHECK_THAT(error_of(kBase + "tuning: {direct_max_bytes: 1GiB}\n"), Catch::StartsWith("tuning.direct_max_bytes:"));
    CHECK_THAT(error_of(kBase + "tuning: {link_mbit: 0}\n"), Catch::StartsWith("tuning.link_mbit:"));
    CHECK_THAT(error_of(kBase + "tuning: {chunk_bytes: 1KiB}\n"), Catch::StartsWith("tuning.chunk_bytes:"));
    CHECK_THAT(error_of(kBase + "tcp: {socket_buffer: 1KiB}\n"), Catch::StartsWith("tcp.socket_buffer: must be auto or"));
    CHECK_THAT(error_of(kBase + "tcp: {socket_buffer: 2GiB}\n"), Catch::StartsWith("tcp.socket_buffer: must be auto or"));
    CHECK_THAT(error_of(kBase + "tcp: {socket_buffer: lots}\n"), Catch::StartsWith("tcp.socket_buffer: must be auto or"));
    CHECK_THAT(error_of(kBase + "tcp: {socket_buffer: [1]}\n"), Catch::StartsWith("tcp.socket_buffer:"));
    CHECK_THAT(error_of(kBase + "tcp: {zero_copy: maybe}\n"), Catch::StartsWith("tcp.zero_copy: 'maybe' is not true or false"));
    {
        auto c = parse_config(kBase + "tcp: {zero_copy: false}\n");
        REQUIRE(c.ok());
        CHECK_FALSE(c->tcp.zero_copy);
    }
    {
        auto c = parse_config(kBase + "tcp: {socket_buffer: 4MiB}\n");
        REQUIRE(c.ok());
        CHECK(c->tcp.socket_buffer == 4u << 20);
        auto d = parse_config(kBase + "tcp: {socket_buffer: auto}\n");
        REQUIRE(d.ok());
        CHECK(d->tcp.socket_buffer == 0);
        auto e = parse_config(kBase);
        REQUIRE(e.ok());
        CHECK(e->tcp.socket_buffer == 0);
        CHECK(e->tuning.chunk_bytes == 2u << 20);
        CHECK(e->tuning.depth == 4);
    }
    CHECK_THAT(error_of(kBase + "tuning: {control_spin_us: 20000}\n"), Catch::StartsWith("tuning.control_spin_us:"));
    CHECK_THAT(error_of(kBase + "tuning: {chunk_bytes: 64MiB, depth: 32}\n"), Catch::StartsWith("tuning.depth:"));
    CHECK_THAT(error_of(kBase + "poll: busy\npoll: event\n"), Catch::StartsWith("poll: appears twice"));
    CHECK_THAT(error_of(kBase + "tuning: {depth: 2, depth: 3}\n"), Catch::StartsWith("tuning.depth: appears twice"));
    CHECK_THAT(error_of("hosts: []\ncluster: c\n"), Catch::StartsWith("hosts:"));
    CHECK_THAT(error_of("hosts:\n  - {name: a, address: x}\n"), Catch::StartsWith("cluster: missing"));
    CHECK_THAT(error_of("cluster: c\nhosts:\n  - {name: a}\n"), Catch::StartsWith("hosts[0].address: missing"));
    CHECK_THAT(error_of("cluster: c\nhosts:\n  - {name: a, address: x, port: 70000}\n"), Catch::StartsWith("hosts[0].port:"));
    CHECK_THAT(error_of("cluster: c\nhosts:\n  - {name: a, address: x}\n  - {name: a, address: y}\n"),
               Catch::StartsWith("hosts[1].name: 'a' appears twice"));
    CHECK_THAT(error_of("cluster: c\nhosts:\n  - {name: 'a:b', address: x}\n"),
               Catch::StartsWith("hosts[0].name: 'a:b' may contain only letters"));
    CHECK_THAT(error_of("cluster: c\nhosts:\n  - {name: a, address: x, colour: red}\n"),
               Catch::StartsWith("hosts[0].colour: unknown key"));
    // Several hosts authenticate each other unless the config opts out.
    const std::string two = "cluster: c\nhosts:\n  - {name: a, address: x}\n  - {name: b, address: y}\n";
    CHECK_THAT(error_of(two), Catch::StartsWith("auth.secret_file: missing"));
    CHECK_THAT(error_of(two + "auth: {insecure: yes}\n"), Catch::StartsWith("auth.insecure: 'yes' is not true or false"));
    CHECK_THAT(error_of(two + "auth: {insecure: false}\n"), Catch::StartsWith("auth.secret_file: missing"));
    CHECK(parse_config(two + "auth: {insecure: true}\n")->insecure);
    CHECK(parse_config(two + "auth: {secret_file: /etc/ringd/secret}\n")->secret_file == "/etc/ringd/secret");
    CHECK_FALSE(parse_config(kBase)->insecure);  // one host: nothing to authenticate
    // auth.data: none by default; mac for TCP; ibverbs cannot (the NIC writes the data).
    CHECK_FALSE(parse_config(two + "auth: {secret_file: /s}\n")->data_mac);
    CHECK(parse_config(two + "auth: {secret_file: /s, data: mac}\n")->data_mac);
    CHECK_THAT(error_of(two + "auth: {secret_file: /s, data: yes}\n"), Catch::StartsWith("auth.data: "));
    CHECK_THAT(error_of(two + "transport: ibverbs\nauth: {secret_file: /s, data: mac}\n"),
               Catch::StartsWith("auth.data: mac is for TCP data streams"));
    CHECK_FALSE(parse_config(two + "transport: ibverbs\nauth: {secret_file: /s, data: none}\n")->data_mac);
    CHECK_THAT(error_of("cluster: [\n"), Catch::StartsWith("YAML syntax"));
    CHECK_THAT(error_of(""), Catch::Contains("empty"));
    CHECK_THAT(error_of("- a\n- b\n"), Catch::Contains("expected a mapping"));
}

TEST_CASE("unreadable file and unknown host", "[config]") {
    auto c = load_config("/nonexistent/ringd.yaml");
    REQUIRE_FALSE(c.ok());
    CHECK_THAT(c.error().message, Catch::Contains("/nonexistent/ringd.yaml"));
    auto ok = parse_config(kBase);
    REQUIRE(ok.ok());
    CHECK(find_host(*ok, "a").ok());
    CHECK_THAT(find_host(*ok, "b").error().message, Catch::Contains("configured: a"));
}

TEST_CASE("sizes and durations", "[config]") {
    CHECK(parse_size("4096") == 4096u);
    CHECK(parse_size("4K") == 4096u);
    CHECK(parse_size("64MiB") == 64u << 20);
    CHECK(parse_size("1 GiB") == 1u << 30);
    CHECK_FALSE(parse_size("").has_value());
    CHECK_FALSE(parse_size("1.5G").has_value());
    CHECK_FALSE(parse_size("99999999999999999999").has_value());
    CHECK_FALSE(parse_size("17179869184G").has_value());
    CHECK(parse_duration("250ms") == std::chrono::milliseconds(250));
    CHECK(parse_duration("2h") == std::chrono::hours(2));
    CHECK_FALSE(parse_duration("5").has_value());
    CHECK(format_bytes(256u << 20) == "256 MiB");
    CHECK(format_bytes(1536) == "1.5 KiB");
}

TEST_CASE("metrics.listen: off by default, ADDRESS:PORT with an IPv4 or bracketed IPv6 address", "[config]") {
    auto c = parse_config(kBase);
    REQUIRE(c.ok());
    CHECK(c->metrics.listen.empty());
    for (const std::string ok : {"127.0.0.1:9465", "0.0.0.0:0", "[::1]:9465", "[::]:65535"}) {
        INFO(ok);
        auto m = parse_config(kBase + "metrics: {listen: \"" + ok + "\"}\n");
        REQUIRE(m.ok());
        CHECK(m->metrics.listen == ok);
    }
    CHECK(parse_config(kBase + "metrics: {listen: \"\"}\n")->metrics.listen.empty());
    auto v6 = parse_config(kBase + "metrics: {listen: \"[::1]:9465\"}\n");
    REQUIRE(v6.ok());
    CHECK(v6->metrics.address == "::1");
    CHECK(v6->metrics.port == 9465);
    auto v4 = parse_config(kBase + "metrics: {listen: \"127.0.0.1:0\"}\n");
    REQUIRE(v4.ok());
    CHECK(v4->metrics.address == "127.0.0.1");
    CHECK(v4->metrics.port == 0);
    for (const std::string bad : {"127.0.0.1", "localhost:9465", "::1:9465", "127.0.0.1:65536", "127.0.0.1:", ":9465",
                                  "127.0.0.1:94x5", "[::1:9465", "1.2.3:80", "127.0.0.1:099999"}) {
        INFO(bad);
        CHECK_THAT(error_of(kBase + "metrics: {listen: \"" + bad + "\"}\n"), Catch::StartsWith("metrics.listen:"));
    }
    CHECK_THAT(error_of(kBase + "metrics: {port: 9465}\n"), Catch::StartsWith("metrics.port: unknown key"));
}

TEST_CASE("topology: this machine's sysfs, pinned by default; pin on/off, an absolute root", "[config]") {
    auto c = parse_config(kBase);
    REQUIRE(c.ok());
    CHECK(c->topology.sysfs_root == "/");
    CHECK(c->topology.pin);
    auto off = parse_config(kBase + "topology: {pin: off, sysfs_root: /tmp/machine}\n");
    REQUIRE(off.ok());
    CHECK_FALSE(off->topology.pin);
    CHECK(off->topology.sysfs_root == "/tmp/machine");
    CHECK(parse_config(kBase + "topology: {pin: true}\n")->topology.pin);
    CHECK_THAT(error_of(kBase + "topology: {pin: maybe}\n"), Catch::StartsWith("topology.pin:"));
    CHECK_THAT(error_of(kBase + "topology: {sysfs_root: machine}\n"), Catch::StartsWith("topology.sysfs_root: must be an absolute path"));
    CHECK_THAT(error_of(kBase + "topology: {numa: 1}\n"), Catch::StartsWith("topology.numa: unknown key"));
}

TEST_CASE("hosts: one address per rail, every host as many, optional weights; tcp only", "[config][rails]") {
    const std::string two = "cluster: c\nauth: {insecure: true}\nhosts:\n"
                            "  - {name: a, address: [10.0.0.1, 10.1.0.1], port: 7400, weights: [2, 0.5]}\n"
                            "  - {name: b, address: [10.0.0.2, 10.1.0.2], port: 7400}\n";
    auto c = parse_config(two);
    REQUIRE(c.ok());
    CHECK(c->hosts[0].address == "10.0.0.1");
    CHECK(c->hosts[0].rail_count() == 2);
    CHECK(c->hosts[0].rail_address(1) == "10.1.0.1");
    CHECK(c->hosts[0].rail_weight(0) == 2);
    CHECK(c->hosts[0].rail_weight(1) == 0.5);
    CHECK(c->hosts[1].rail_weight(1) == 1);
    CHECK(parse_config(kBase)->hosts[0].rail_count() == 1);
    const std::string h = "cluster: c\nauth: {insecure: true}\nhosts:\n";
    CHECK_THAT(error_of(h + "  - {name: a, address: [10.0.0.1, 10.1.0.1]}\n  - {name: b, address: 10.0.0.2}\n"),
               Catch::StartsWith("hosts[1].address: every host lists as many addresses (rails): a has 2, b 1"));
    CHECK_THAT(error_of(h + "  - {name: a, address: []}\n"), Catch::StartsWith("hosts[0].address: a list of 1 to 16"));
    CHECK_THAT(error_of(h + "  - {name: a, address: [10.0.0.1, \"\"]}\n"), Catch::StartsWith("hosts[0].address[1]: is empty"));
    CHECK_THAT(error_of(h + "  - {name: a, address: [10.0.0.1, 10.0.0.1]}\n"), Catch::StartsWith("hosts[0]: address 10.0.0.1:7400 appears twice"));
    CHECK_THAT(error_of(h + "  - {name: a, address: 10.0.0.1, weights: [1, 2]}\n"), Catch::StartsWith("hosts[0].weights: one weight per address (1)"));
    CHECK_THAT(error_of(h + "  - {name: a, address: [10.0.0.1, 10.1.0.1], weights: [1, 0]}\n"),
               Catch::StartsWith("hosts[0].weights[1]: '0' is not a positive number"));
    CHECK_THAT(error_of(h + "  - {name: a, address: [10.0.0.1, 10.1.0.1], weights: [1, x]}\n"), Catch::StartsWith("hosts[0].weights[1]:"));
    CHECK_THAT(error_of(two + "transport: ibverbs\n"), Catch::StartsWith("hosts: several addresses per host (rails) are for transport: tcp"));
    CHECK_THAT(error_of(h + "  - {name: a, address: [10.0.0.1, 10.1.0.1, 10.2.0.1, 10.3.0.1, 10.4.0.1]}\ntcp: {streams: 64}\n"),
               Catch::StartsWith("tcp.streams: 64 streams on each of 5 rails: at most 256 connections per link"));
    CHECK(parse_config(h + "  - {name: a, address: [10.0.0.1, 10.1.0.1, 10.2.0.1, 10.3.0.1], weights: [1, 1, 1, 1]}\ntcp: {streams: 64}\n").ok());
}

TEST_CASE("wire: default format, feedback bound and schedule", "[config][wire]") {
    auto d = parse_config(kBase);
    REQUIRE(d.ok());
    CHECK(d->wire.format == WireFormat::Exact);
    CHECK(d->wire.exchange);
    auto c = parse_config(kBase + "wire: {default: int8, feedback_max_bytes: 1MiB, schedule: ring}\n");
    REQUIRE(c.ok());
    CHECK(c->wire.format == WireFormat::Int8);
    CHECK(c->wire.feedback_max_bytes == (1u << 20));
    CHECK_FALSE(c->wire.exchange);
    CHECK_THAT(error_of(kBase + "wire: {schedule: tree}\n"), Catch::Contains("wire.schedule"));
}
