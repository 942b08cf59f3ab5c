// libFuzzer: what a client may send ringd on its Unix socket (hello, status request, error, CUDA
// register/unregister), frame after frame, through the same header check and decoders the
// daemon uses. A frame a decoder accepts must encode back to a frame that decodes the same.
#include <cstdint>
#include <cstring>
#include <span>

#include "proto/frame.h"

using namespace ringd::proto;

namespace {

void must(bool ok) {
    if (!ok) __builtin_trap();
}

void one(FrameType type, std::span<const uint8_t> p) {
    auto payload_of = [](const Bytes &f) { return std::span<const uint8_t>(f).subspan(kFrameHeaderBytes); };
    switch (type) {
    case FrameType::Hello:
        if (auto h = decode_hello(p)) {
            auto again = decode_hello(payload_of(encode_hello(*h)));
            must(again.ok() && again->group == h->group && again->hosts == h->hosts && again->slot_bytes == h->slot_bytes);
        }
        break;
    case FrameType::HelloShared:
        if (auto h = decode_hello_shared(p)) {
            auto again = decode_hello_shared(payload_of(encode_hello(*h)));
            must(again.ok() && again->share_with == h->share_with && again->group == h->group && again->hosts == h->hosts);
        }
        break;
    case FrameType::StatusRequest: (void)decode_status_request(p); break;
    case FrameType::Error:
        if (auto e = decode_error(p)) must(decode_error(payload_of(encode_error(*e)))->message == e->message);
        break;
    case FrameType::CudaRegister:
        if (auto r = decode_cuda_register(p)) {
            auto again = decode_cuda_register(payload_of(encode_cuda_register(*r)));
            must(again.ok() && again->offset == r->offset && again->bytes == r->bytes && r->offset + r->bytes <= r->alloc_bytes);
        }
        break;
    case FrameType::CudaUnregister: (void)decode_cuda_unregister(p); break;
    case FrameType::CudaReply:
        if (auto r = decode_cuda_reply(p)) must(decode_cuda_reply(payload_of(encode_cuda_reply(*r)))->message == r->message);
        break;
    case FrameType::Welcome:
        if (auto w = decode_welcome(p)) must(w->data_offset <= w->map_bytes && w->map_bytes - w->data_offset >= w->data_bytes);
        break;
    default: break;  // the daemon refuses any other type from a client
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    std::span<const uint8_t> in(data, size);
    while (in.size() >= kFrameHeaderBytes) {
        auto h = decode_frame_header(in.first(kFrameHeaderBytes), kMaxClientPayload);
        if (!h) return 0;  // the daemon drops the client here
        must(h->length <= kMaxClientPayload);
        in = in.subspan(kFrameHeaderBytes);
        if (in.size() < h->length) return 0;
        one(h->type, in.first(h->length));
        in = in.subspan(h->length);
    }
    return 0;
}
