"""The protocol: what travels between workers, independent of how it travels.

wire.py           the frame format, the handshake's messages and every extras key (one page)
serialization.py  messages to frames: tensors out of band, metas in the head, pickle for the rest
allowlist.py      serializer="safe": the functions and classes a message may name
safe_encoding.py  serializer="safe": rpc_core's own encoding of the rest (safe_decoding.py reads it)
safe_codec.py     serializer="safe": the codec serialization uses instead of pickle
torchscript.py    scripted functions and modules inside messages
"""
