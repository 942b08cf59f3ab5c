// ringd's logging: spdlog with two things in front of the sink.
//
// - Repeats are rate-limited. Messages of warn and above are grouped by kind (the text with its
//   numbers replaced, error_kind()); within a window of kRepeatWindow the first kRepeatBurst of a
//   kind are logged, the rest only counted, and when the window ends one line says how many of
//   that kind were left out and shows the last. A storm of one error (every op of a job timing
//   out) cannot bury the one line that says why.
// - Under systemd the lines go to the journal with fields (sd_journal_send): PRIORITY,
//   SYSLOG_IDENTIFIER=ringd, RINGD_HOST, RINGD_CLUSTER, RINGD_KIND, and, when the message names
//   them, RINGD_GROUP, RINGD_OP (the op's seq in its group), RINGD_GENERATION (the ring
//   generation: the coordinator numbers it, so it is the same on every host of the ring) and
//   RINGD_PEER (another host); RINGD_REPEATS on the line that counts left-out repeats.
//   `journalctl -u ringd RINGD_GROUP=job7` is one job's story on one host.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace ringd::logging {

constexpr auto kRepeatWindow = std::chrono::seconds(10);
constexpr size_t kRepeatBurst = 5;

// The text with every run of digits replaced by N: messages that differ only in numbers (op
// seqs, generations, byte counts, ages) are of one kind.
std::string error_kind(const std::string &message);

// The journal fields a message names: RINGD_GROUP, RINGD_OP, RINGD_GENERATION, RINGD_PEER (as
// "KEY=value", at most one of each; the first mention wins).
std::vector<std::string> fields_of(const std::string &message);

enum class Journal { Auto, On, Off };
// Whether ringd's stderr is the journal: systemd sets JOURNAL_STREAM to stderr's device:inode
// when it connects the two (systemd.exec(5)).
bool stderr_is_journal();
// Where journald takes native entries (sd_journal_sendv's socket), and whether something listens
// there (a datagram connect succeeds).
inline constexpr const char *kJournalSocket = "/run/systemd/journal/socket";
bool journal_reachable();

// Replaces the default logger's sinks: the journal (with `host` and `cluster` in every entry;
// `hosts`, the configured host names, tell RINGD_PEER) or stderr as before, behind the repeat
// limiter. Before it is called, ringd logs to stderr.
void setup(const std::string &host, const std::string &cluster, bool journal, const std::vector<std::string> &hosts);
// Writes the counts of left-out repeats whose window ended (the control thread's timer calls
// it; any later log line does too).
void flush_repeats();

}  // namespace ringd::logging
