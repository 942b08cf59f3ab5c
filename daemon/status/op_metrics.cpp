#include "daemon/status/op_metrics.h"

#include <algorithm>
#include <vector>

namespace ringd {
namespace {

// The entry of `key`, made on first use (the only allocation).
template <class V>
V &entry(std::map<std::string, V, std::less<>> &m, std::string_view key) {
    auto it = m.find(key);
    if (it == m.end()) it = m.emplace(std::string(key), V{}).first;
    return it->second;
}

}  // namespace

void OpMetrics::ended(std::string_view group, std::string_view algorithm, bool ok, uint64_t bytes, double seconds,
                      Clock::time_point now) {
    Group &g = entry(groups_, group);
    g.last_seen = now;
    for (Series *s : {&entry(g.by_algorithm, algorithm), &entry(totals_, algorithm)}) {
        if (ok) {
            ++s->completed;
            s->bytes += bytes;
        } else {
            ++s->failed;
        }
    }
    if (seconds < 0) return;  // not timed
    Histogram &h = entry(durations_, algorithm);
    const auto at = std::lower_bound(kBuckets.begin(), kBuckets.end(), seconds) - kBuckets.begin();
    ++h.counts[static_cast<size_t>(at)];
    h.sum += seconds;
    ++h.count;
}

const OpMetrics::Series *OpMetrics::series(std::string_view group, std::string_view algorithm) const {
    auto g = groups_.find(group);
    if (g == groups_.end()) return nullptr;
    auto s = g->second.by_algorithm.find(algorithm);
    return s == g->second.by_algorithm.end() ? nullptr : &s->second;
}

void OpMetrics::forget_gone(const std::set<std::string> &live, Clock::time_point now) {
    std::vector<std::pair<Clock::time_point, std::string>> gone;
    for (const auto &[name, g] : groups_)
        if (!live.count(name)) gone.emplace_back(g.last_seen, name);
    std::sort(gone.begin(), gone.end());
    size_t over = groups_.size() > kMaxGroups ? groups_.size() - kMaxGroups : 0;
    for (const auto &[when, name] : gone) {
        if (now - when < kKeepGone && over == 0) break;  // sorted: the rest are younger
        if (over > 0) --over;
        groups_.erase(name);
    }
}

}  // namespace ringd
