// FrameReader: reads one frame at a time from a non-blocking socket, header first; the length
// is checked against the caller's cap before any payload buffer is sized. File descriptors
// sent along are refused (closed, and an error returned).
#pragma once

#include <optional>

#include "proto/frame.h"

namespace ringd {

struct Frame {
    proto::FrameType type{};
    proto::Bytes payload;
};

class FrameReader {
public:
    // A complete frame, nullopt when the socket has no more bytes for now (EAGAIN), or an error:
    // EOF (-ECONNRESET), an I/O error, fds received, a bad or oversize header.
    Result<std::optional<Frame>> read(int fd, uint32_t max_payload);
    bool idle() const { return in_.empty(); }  // no partial frame buffered

private:
    proto::Bytes in_;
    std::optional<proto::FrameHeader> header_;
};

}  // namespace ringd
