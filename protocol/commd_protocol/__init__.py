"""commd's wire protocol: typed MessagePack messages shared by the daemon and its clients."""

from .codec import MAX_MESSAGE_BYTES, Codec, ProtocolViolation, encode
from .errors import (
    CommdError,
    CommdTimeout,
    CommdTypeError,
    CommdValueError,
    ErrorCode,
    error_from_reply,
    prefixed,
)
from .ipc import INTERPROCESS_EVENT_FLAGS, IPC_HANDLE_BYTES
from .messages import (
    DEVICES,
    DTYPES,
    OPS,
    PROTOCOL_VERSION,
    ClientMessage,
    DaemonMessage,
    Done,
    Error,
    Goodbye,
    Hello,
    Layer,
    Ready,
    Register,
    Registered,
    StatusReply,
    StatusRequest,
    Wait,
    Welcome,
)
from .peer import (
    PeerAbort,
    PeerJoin,
    PeerLeave,
    PeerMessage,
    PeerPlan,
    PeerProfile,
    PeerSetup,
)

__version__ = "0.1.0"
DEFAULT_PEER_PORT = 29600
DEFAULT_SOCKET = "/run/commd/commd.sock"

__all__ = [
    "DEFAULT_PEER_PORT",
    "DEFAULT_SOCKET",
    "DEVICES",
    "DTYPES",
    "INTERPROCESS_EVENT_FLAGS",
    "IPC_HANDLE_BYTES",
    "MAX_MESSAGE_BYTES",
    "OPS",
    "PROTOCOL_VERSION",
    "ClientMessage",
    "Codec",
    "CommdError",
    "CommdTimeout",
    "CommdTypeError",
    "CommdValueError",
    "DaemonMessage",
    "Done",
    "Error",
    "ErrorCode",
    "Goodbye",
    "Hello",
    "Layer",
    "PeerAbort",
    "PeerJoin",
    "PeerLeave",
    "PeerMessage",
    "PeerPlan",
    "PeerProfile",
    "PeerSetup",
    "ProtocolViolation",
    "Ready",
    "Register",
    "Registered",
    "StatusReply",
    "StatusRequest",
    "Wait",
    "Welcome",
    "encode",
    "error_from_reply",
    "prefixed",
]
