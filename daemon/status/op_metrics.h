// OpMetrics: what every op that ended on this host adds to the Prometheus counters (metrics.listen,
// daemon/status/metrics_server.h): ops completed and failed and bytes reduced by group and
// algorithm, and how long ops took by algorithm (a histogram). Kept by the GroupTable, where every
// op ends; read by the control thread when /metrics is scraped.
//
// A group's series outlive the group by kKeepGone, so that the last increments of a job that ended
// reach a scraper, and are then dropped: every job (and every restart) is a group of its own, and
// a daemon that runs for months must not keep one series per job it ever saw. At most kMaxGroups
// groups keep series; past that the longest idle gone group goes first (its counts stay in the
// totals, which have no group label).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>

namespace ringd {

class OpMetrics {
public:
    using Clock = std::chrono::steady_clock;
    static constexpr auto kKeepGone = std::chrono::minutes(10);
    static constexpr size_t kMaxGroups = 512;
    // Upper bounds of the duration histogram's buckets, in seconds (+Inf is implied).
    static constexpr std::array<double, 16> kBuckets = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                                        0.05,   0.1,     0.25,   0.5,   1,      2.5,    10,    30};

    struct Series {
        uint64_t completed = 0, failed = 0, bytes = 0;
    };
    struct Histogram {
        std::array<uint64_t, kBuckets.size() + 1> counts{};  // per bucket (not cumulative); last: +Inf
        double sum = 0;
        uint64_t count = 0;
    };

    // An op of `group` ended: `algorithm` is the path it took ("local", "ring", "one-shot",
    // "two-shot"; "none" for an op that failed before one was chosen), `seconds` from its first
    // local submission to its end (negative: not timed, e.g. an op that never took a path),
    // `bytes` what one rank contributed (counted on success only).
    void ended(std::string_view group, std::string_view algorithm, bool ok, uint64_t bytes, double seconds,
               Clock::time_point now);
    // Drops the series of groups that are not in `live` and have been gone for kKeepGone.
    void forget_gone(const std::set<std::string> &live, Clock::time_point now);

    // The series of one group, by algorithm, and when its last op ended.
    struct Group {
        std::map<std::string, Series, std::less<>> by_algorithm;
        Clock::time_point last_seen;
    };
    // By group (lookups take a string_view: no allocation per op once a series exists).
    const std::map<std::string, Group, std::less<>> &groups() const { return groups_; }
    // One series, or null.
    const Series *series(std::string_view group, std::string_view algorithm) const;
    // By algorithm, every op that ended (successes and failures).
    const std::map<std::string, Histogram, std::less<>> &durations() const { return durations_; }
    // Every op since the start, by algorithm, whatever its group (dropped groups included).
    const std::map<std::string, Series, std::less<>> &totals() const { return totals_; }

private:
    std::map<std::string, Group, std::less<>> groups_;
    std::map<std::string, Histogram, std::less<>> durations_;
    std::map<std::string, Series, std::less<>> totals_;
};

}  // namespace ringd
