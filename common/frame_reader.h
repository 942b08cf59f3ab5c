// FrameReader: reads frames from a non-blocking socket through a small buffer (one recv
// usually brings several small frames); a header's length is checked against the caller's cap
// before any payload buffer is sized, and large payloads are received straight into the frame.
// File descriptors sent along are refused (closed, and an error returned), unless the caller
// allows some: then those received go with the next frame that completes (a sender passes them
// with the first bytes of their frame), never more than the cap at once. Call read() until it
// returns nullopt; after a short read it returns nullopt without a system call.
#pragma once

#include <optional>
#include <vector>

#include "common/unique_fd.h"

#include "proto/frame.h"

namespace ringd {

struct Frame {
    proto::FrameType type{};
    proto::Bytes payload;
    std::vector<UniqueFd> fds;  // passed with it (only when the reader allows fds)
    uint16_t version = 0;       // its header's (proto/frame.h)
};

class FrameReader {
public:
    // A complete frame, nullopt when the socket has no more bytes for now (EAGAIN), or an error:
    // EOF (-ECONNRESET), an I/O error, fds received, a bad or oversize header.
    Result<std::optional<Frame>> read(int fd, uint32_t max_payload, size_t max_fds = 0);
    bool idle() const { return !header_ && head_ == tail_; }  // no partial frame buffered

private:
    static constexpr size_t kBufferBytes = 64 << 10;
    std::vector<uint8_t> buf_;  // sized on first use
    size_t head_ = 0, tail_ = 0;
    bool drained_ = false;
    std::optional<proto::FrameHeader> header_;
    proto::Bytes payload_;  // sized from the checked header
    size_t got_ = 0;
    std::vector<UniqueFd> fds_;  // received, for the frame being read
};

}  // namespace ringd
