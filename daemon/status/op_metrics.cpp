#include "daemon/status/op_metrics.h"

#include <algorithm>
#include <vector>

namespace ringd {

void OpMetrics::ended(const std::string &group, const std::string &algorithm, bool ok, uint64_t bytes, double seconds,
                      Clock::time_point now) {
    for (Series *s : {&series_[{group, algorithm}], &totals_[algorithm]}) {
        if (ok) {
            ++s->completed;
            s->bytes += bytes;
        } else {
            ++s->failed;
        }
    }
    last_seen_[group] = now;
    if (seconds < 0) return;  // not timed
    Histogram &h = durations_[algorithm];
    const auto at = std::lower_bound(kBuckets.begin(), kBuckets.end(), seconds) - kBuckets.begin();
    ++h.counts[static_cast<size_t>(at)];
    h.sum += seconds;
    ++h.count;
}

void OpMetrics::forget_gone(const std::set<std::string> &live, Clock::time_point now) {
    std::vector<std::pair<Clock::time_point, std::string>> gone;
    for (const auto &[group, when] : last_seen_)
        if (!live.count(group)) gone.emplace_back(when, group);
    std::sort(gone.begin(), gone.end());
    size_t over = last_seen_.size() > kMaxGroups ? last_seen_.size() - kMaxGroups : 0;
    for (const auto &[when, group] : gone) {
        if (now - when < kKeepGone && over == 0) break;  // sorted: the rest are younger
        if (over > 0) --over;
        last_seen_.erase(group);
        for (auto it = series_.lower_bound({group, std::string()}); it != series_.end() && it->first.first == group;)
            it = series_.erase(it);
    }
}

}  // namespace ringd
