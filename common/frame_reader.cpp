#include "common/frame_reader.h"

#include <algorithm>

#include "common/fd_io.h"

namespace ringd {

Result<std::optional<Frame>> FrameReader::read(int fd, uint32_t max_payload) {
    for (;;) {
        const size_t want = header_ ? proto::kFrameHeaderBytes + header_->length : proto::kFrameHeaderBytes;
        if (in_.size() == want) {
            if (!header_) {
                auto h = proto::decode_frame_header(in_, max_payload);
                if (!h) return h.error();
                header_ = *h;
                in_.reserve(proto::kFrameHeaderBytes + h->length);  // capped by the check above
                if (h->length > 0) continue;
            }
            Frame f{header_->type, proto::Bytes(in_.begin() + proto::kFrameHeaderBytes, in_.end())};
            header_.reset();
            in_.clear();
            return std::optional<Frame>(std::move(f));
        }
        uint8_t buf[512];
        std::vector<UniqueFd> fds;
        const ssize_t n = recv_some(fd, buf, std::min(sizeof buf, want - in_.size()), fds);
        if (n == -EAGAIN || n == -EWOULDBLOCK) return std::optional<Frame>();
        if (n < 0) return make_error(static_cast<int>(n), "receive: " + errno_string(static_cast<int>(n)));
        if (!fds.empty()) return make_error(-EPROTO, "file descriptors were sent; ringd accepts none");
        if (n == 0) {
            if (in_.empty()) return make_error(-ECONNRESET, "disconnected");
            return make_error(-ECONNRESET, "disconnected in the middle of a frame");
        }
        in_.insert(in_.end(), buf, buf + n);
    }
}

}  // namespace ringd
