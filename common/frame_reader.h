// FrameReader: reads one frame at a time from a non-blocking socket, header first; the length
// is checked against the caller's cap before any payload buffer is sized. File descriptors
// sent along are refused (closed, and an error returned).
#pragma once

#include <array>
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
    bool idle() const { return header_got_ == 0; }  // no partial frame buffered

private:
    std::array<uint8_t, proto::kFrameHeaderBytes> header_buf_{};
    size_t header_got_ = 0;
    std::optional<proto::FrameHeader> header_;
    proto::Bytes payload_;  // sized from the checked header
    size_t got_ = 0;
};

}  // namespace ringd
