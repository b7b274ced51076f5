"""The wire: one frozen dataclass per message, one msgpack codec, every subject in one module."""

from nitsum.wire.codec import MAX_FRAME_BYTES, DecodeError, EncodeError, WireError, decode, encode
from nitsum.wire.messages import MESSAGE_TYPES

__all__ = ["DecodeError", "EncodeError", "MAX_FRAME_BYTES", "MESSAGE_TYPES", "WireError", "decode", "encode"]
