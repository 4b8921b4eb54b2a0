"""Every message on the client socket, one Union per direction, and their decoders."""

from __future__ import annotations

import msgspec

from modelpool.protocol.jobs import JobRequest, JobResponse
from modelpool.protocol.messages import (
    ControlReply,
    ControlRequest,
    Hello,
    Welcome,
    WorkReply,
    WorkRequest,
)

ClientMessage = Hello | WorkRequest | ControlRequest | JobRequest
ServerMessage = Welcome | WorkReply | ControlReply | JobResponse

# Built once: msgspec decoders are cheap to call and costly to build.
client_decoder = msgspec.msgpack.Decoder(ClientMessage)
server_decoder = msgspec.msgpack.Decoder(ServerMessage)
